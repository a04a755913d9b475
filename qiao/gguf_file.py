"""GGUF files as the engine's edges see them: which paths are one, and the tokenizer its
metadata describes. The weights and architecture are qiao.models.gguf's; this leaf sits below
every layer so that qiao.tokenizer can build a GGUF's tokenizer.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from qiao.errors import ModelLoadError

GGUF_SUFFIX = ".gguf"
NO_TOKEN_ID = 0xFFFFFFFF  # llama.cpp's "no such token"


def is_gguf_path(path: str | Path) -> bool:
    """A `.gguf` file, or a directory with no config.json that holds `.gguf` file(s)."""
    path = Path(path).expanduser()
    if path.suffix == GGUF_SUFFIX:
        return True
    return (
        path.is_dir() and not (path / "config.json").is_file() and any(path.glob(f"*{GGUF_SUFFIX}"))
    )


def find_gguf_file(path: str | Path) -> Path:
    """The one `.gguf` file `path` names or holds."""
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
        if len(files) != 1:
            names = ", ".join(f.name for f in files) or "none"
            raise ModelLoadError(
                f"{path} must hold exactly one {GGUF_SUFFIX} file (found: {names}); "
                "pass the file's path instead"
            )
        return files[0]
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    return path


# --- tokenizer --------------------------------------------------------------------------------


def load_gguf_tokenizer(path: str | Path) -> Any:
    """A transformers fast tokenizer from the file's `tokenizer.ggml.*` metadata: "llama"
    (SentencePiece: tokens, scores, token types) or "gpt2" (byte-level BPE: tokens, merges, the
    pre-tokenizer `tokenizer.ggml.pre` names), with bos / eos / unk / pad and the chat template.
    The vocabulary is turned into a `tokenizers` model by transformers' own GGUF conversion."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer

    file = find_gguf_file(path)
    meta = read_gguf_metadata(file)
    arch = meta.get("general.architecture", "")
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("llama", "gpt2"):
        raise ModelLoadError(
            f"{file.name}: GGUF tokenizer {kind!r} is not supported; supported: llama "
            "(SentencePiece), gpt2 (BPE)"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    source = {
        "tokenizer_type": kind,
        "pre_tokenizer_type": meta.get("tokenizer.ggml.pre"),
        "tokens": tokens,
        "scores": meta.get("tokenizer.ggml.scores"),
        "token_type": meta.get("tokenizer.ggml.token_type"),
        "merges": meta.get("tokenizer.ggml.merges"),
        "add_prefix_space": meta.get("tokenizer.ggml.add_space_prefix"),
    }
    source = {k: v for k, v in source.items() if v is not None}
    try:
        backend, _ = convert_gguf_tokenizer(arch, source)
    except Exception as e:  # the conversion raises many types; name the file
        raise ModelLoadError(f"{file.name}: cannot build its tokenizer ({e})") from e
    specials = {}
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and token_id != NO_TOKEN_ID and token_id < len(tokens):
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            specials[f"{key}_token"] = tokens[token_id]
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=meta.get("tokenizer.chat_template"),
        **specials,
    )
    _set_add_bos(tokenizer, bool(add_bos), specials.get("bos_token"))
    return tokenizer


def _set_add_bos(tokenizer: Any, add_bos: bool, bos: str | None) -> None:
    """Make the backend's post-processor add BOS exactly when the file asks for it."""
    from tokenizers import processors

    if add_bos and bos is not None:
        bos_id = tokenizer.convert_tokens_to_ids(bos)
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    else:
        tokenizer.backend_tokenizer.post_processor = None


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata field of the file as a plain value (key -> value), cached per file."""
    file = find_gguf_file(path)
    stat = file.stat()
    return _read_cached(str(file.resolve()), stat.st_mtime_ns, stat.st_size)[0]


def open_gguf_reader(path: str | Path) -> tuple[dict[str, Any], Any]:
    """(metadata, gguf.GGUFReader) of the file, cached per file (path, mtime, size)."""
    file = find_gguf_file(path)
    stat = file.stat()
    return _read_cached(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read_cached(path: str, _mtime_ns: int, _size: int) -> tuple[dict[str, Any], Any]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct errors, ...: say what it is
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = field.contents()
        except Exception:  # an odd field we never read must not fail the load
            continue
    return metadata, reader
