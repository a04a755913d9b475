"""The HTTP/1.1 protocol the servers run: uvicorn's h11 protocol, with malformed requests
answered in qiao's JSON error envelope.

uvicorn answers a request it cannot parse with a plain-text 400 and closes. Here the answer is
the OpenAI-style envelope every other error uses, and headers past the size limit get 431
(Request Header Fields Too Large), as RFC 6585 asks, instead of 400. Pinned (not uvicorn's
"auto" choice between h11 and httptools) so behaviour does not change with what is installed.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from qiao.api.errors import error_body

# Everything before the body (request line and headers) must fit in this many bytes.
MAX_HEADER_BYTES = 16 * 1024  # h11's default, made explicit


class QiaoH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        buffered, _ = self.conn.trailing_data
        if len(buffered) > MAX_HEADER_BYTES:
            status, message = (
                431,
                f"request headers are too large: at most {MAX_HEADER_BYTES} bytes in all",
            )
        else:
            status, message = 400, "malformed HTTP request"
        body = json.dumps(error_body(status, message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=status, headers=headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()
