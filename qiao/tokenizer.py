"""Tokenizer loading: Hugging Face tokenizer files from a checkpoint directory, never remote code."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from qiao.errors import ModelLoadError
from qiao.gguf_file import is_gguf_path, load_gguf_tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str | Path) -> Any:
    """A `transformers` fast tokenizer for the checkpoint directory `path` (or built from the
    metadata of a `.gguf` file: qiao.gguf_file)."""
    if is_gguf_path(path):
        return load_gguf_tokenizer(path)
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer in {path}: expected one of {', '.join(TOKENIZER_FILES)} "
            "(pass skip_tokenizer_init=True to run on token ids only)"
        )
    try:
        if _names_generic_fast_tokenizer(path):
            # What AutoTokenizer would build, without importing every model's config first
            # (about a second and a half of a server's start).
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=False, local_files_only=True
        )
    except Exception as exc:  # transformers raises many types; report the file, not a traceback
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from exc


def _names_generic_fast_tokenizer(path: Path) -> bool:
    """tokenizer_config.json asks for the generic fast tokenizer over tokenizer.json."""
    config = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config.is_file():
        return False
    try:
        name = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return False
    return name in ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_eos_token_ids(
    path: str | Path, config_eos: tuple[int, ...], tokenizer: Any
) -> tuple[int, ...]:
    """EOS ids: generation_config.json first, then config.json, then the tokenizer."""
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    if config_eos:
        return config_eos
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (int(tokenizer.eos_token_id),)
    return ()
