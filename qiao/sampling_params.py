"""Per-request sampling settings, shaped like vLLM's so offline code ports unchanged."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from qiao.errors import ConfigError

# A request with no seed of its own draws one from the engine, so every request samples through
# the same seeded path and is reproducible from its seed alone.

# Temperatures below this are greedy: dividing logits by them would overflow float32.
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens for one prompt.

    `temperature == 0` means greedy. `top_k <= 0` (or -1) disables top-k. `logprobs=k` returns the
    top-k log-probabilities plus the chosen token's at every generated position; `prompt_logprobs=k`
    the same at every prompt position after the first (computed in the prefill; such a request
    takes no prefix-cache hit, so no position is skipped).

    `structured_outputs` constrains the output (vLLM's names), one of: `{"json": schema}` (a dict
    or its JSON text), `{"json_object": True}`, `{"regex": pattern}`, `{"choice": [strings]}`,
    `{"grammar": lark_or_gbnf}`. See `qiao.runner.grammar`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check(
            isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}"
        )
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                f"must be an integer >= 1, got {self.max_tokens!r}",
            )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if self.logprobs is not None:
            _check(self.logprobs >= 0, "logprobs", f"must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None:
            _check(
                isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0,
                "prompt_logprobs",
                f"must be an integer >= 0, got {self.prompt_logprobs!r}",
            )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        if self.structured_outputs is not None:
            self._validate_structured()

    def _validate_structured(self) -> None:
        kinds = ("json", "json_object", "regex", "choice", "grammar")
        given = self.structured_outputs or {}
        _check(
            isinstance(given, dict) and len(given) == 1 and next(iter(given)) in kinds,
            "structured_outputs",
            f"must give exactly one of {', '.join(kinds)}, got {given!r}",
        )
        kind, spec = next(iter(given.items()))
        if kind == "json":
            ok = isinstance(spec, dict | str | bool)
            _check(ok, "structured_outputs", "json must be a JSON schema (object or its text)")
        elif kind == "choice":
            ok = isinstance(spec, list) and bool(spec) and all(isinstance(c, str) for c in spec)
            _check(ok, "structured_outputs", "choice must be a non-empty list of strings")
        elif kind in ("regex", "grammar"):
            ok = isinstance(spec, str) and bool(spec)
            _check(ok, "structured_outputs", f"{kind} must be a non-empty string")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"SamplingParams.{name} {message}")
