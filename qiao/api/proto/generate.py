"""Regenerates `inference_pb2.py`, `inference_pb2.pyi` and `inference_pb2_grpc.py`.

Run from the repository root: `.venv/bin/python -m qiao.api.proto.generate` (needs grpcio-tools).

One rewrite follows protoc: the messages go into a private descriptor pool instead of protobuf's
process-wide default pool. tritonclient.grpc registers the same `inference.*` names in the default
pool and protobuf refuses a second file defining them, so without the rewrite one process could
not import both (the tests do, and so may a client embedding the server). Message full names never
travel on the wire; the service path `/inference.GRPCInferenceService/...` is unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO = Path("qiao/api/proto/inference.proto")
DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL = "DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile("


def main() -> int:
    if not PROTO.is_file():
        print(f"run from the repository root: {PROTO} not found", file=sys.stderr)
        return 1
    args = ["protoc", "-I", ".", "--python_out=.", "--pyi_out=.", "--grpc_python_out=."]
    if protoc.main([*args, str(PROTO)]) != 0:
        return 1
    module = PROTO.with_name("inference_pb2.py")
    code = module.read_text()
    if code.count(DEFAULT_POOL) != 1:
        print(
            f"{module}: protoc's output changed; update the private-pool rewrite", file=sys.stderr
        )
        return 1
    module.write_text(code.replace(DEFAULT_POOL, PRIVATE_POOL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
