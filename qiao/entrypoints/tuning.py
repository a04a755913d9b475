"""Engine defaults from a tuning profile: what `LLM(...)` and `qiao serve` take from the profile
`qiao tune` wrote for this model on this machine (`qiao/profile.py`).

A profile supplies `num_threads`, `max_num_seqs`, `max_num_batched_tokens` and `num_kv_blocks`
where the caller did not set them; whatever the caller set wins.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qiao import envs
from qiao.config import CacheConfig
from qiao.errors import ConfigError
from qiao.profile import ModelIdentity, ProfileChoice, find_profile, profile_defaults

logger = logging.getLogger("qiao.profile")


def tuned_defaults(model: str, given: Mapping[str, Any], choice: ProfileChoice) -> dict[str, Any]:
    """The profile's values for the tuned settings `given` leaves unset (a None value is unset).

    `given` holds the caller's engine arguments (and `num_threads`); `choice` is "auto", a
    profile file, or None for no profile. Returns {} when no profile applies; logs one line
    naming the profile and what it set when one does.
    """
    if choice is None or (choice == "auto" and not envs.profile_dir().is_dir()):
        return {}
    found = find_profile(choice, model_identity(model, given))
    if found is None:
        return {}
    profile, path = found
    explicit = {name for name, value in given.items() if value is not None}
    values = profile_defaults(profile, given, given.get("block_size") or CacheConfig.block_size)
    applied = ", ".join(f"{name}={value}" for name, value in values.items()) or "nothing"
    kept = sorted(explicit & {*profile.settings.model_dump(), "kv_cache_memory"})
    logger.info(
        "tuning profile %s applied: %s%s",
        path,
        applied,
        f" (given explicitly: {', '.join(kept)})" if kept else "",
    )
    return values


def model_identity(model: str, given: Mapping[str, Any]) -> ModelIdentity:
    """The identity a profile for this checkpoint has: its resolved path, compute dtype and
    quantization, as the engine will resolve them."""
    from qiao.hal.platform import resolve_dtype
    from qiao.models.arch_config import load_arch_config

    path = Path(model).expanduser()
    dtype = given.get("dtype") or "auto"
    checkpoint_dtype = load_arch_config(path).torch_dtype if dtype == "auto" else None
    resolved = str(resolve_dtype(dtype, checkpoint_dtype)).removeprefix("torch.")
    return ModelIdentity.for_checkpoint(path, resolved, given.get("quantization"))


def apply_num_threads(num_threads: int | None) -> None:
    """Set torch's intra-op thread count (process-wide; threads started later inherit it)."""
    if num_threads is None:
        return
    if num_threads < 1:
        raise ConfigError(f"num_threads must be >= 1, got {num_threads}")
    import torch

    torch.set_num_threads(num_threads)
