"""Per-request state shared by the scheduler, the block manager and the runner.

One token-count model covers prefill and decode: a request knows `num_tokens` (prompt + output),
and `num_computed_tokens` of them have their K/V in the cache. Each step the scheduler hands out
`num_tokens - num_computed_tokens` more (capped by the token budget). A fresh prompt, a chunked
prefill, a prefix-cache hit, a decode step and a recompute after preemption are all the same
arithmetic.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from qiao.sampling_params import SamplingParams

if TYPE_CHECKING:
    from qiao.lora.request import LoRARequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Every status after this line is final.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated. A prompt with `n > 1` becomes n of these (one per sample)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        seed: int,
        eos_token_ids: tuple[int, ...],
        max_total_tokens: int,
        priority: int = 0,
        arrival_seq: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        # prompt + output; the runner slices the tokens to compute out of this.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        # Generation stops with "length" here: min(prompt + max_tokens, max_model_len).
        self.max_total_tokens = max_total_tokens
        self.priority = priority
        self.arrival_seq = arrival_seq
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Chained hashes of the full blocks of all_token_ids, extended by the block manager.
        self.block_hashes: list[bytes] = []
        # The structured-output matcher (llguidance) constraining this sample, if any.
        self.grammar: Any = None
        # Draft tokens proposed to follow all_token_ids (speculative decoding), verified in the
        # next decode step; [] when none.
        self.spec_token_ids: list[int] = []
        # Per prompt position 1.. (when params.prompt_logprobs): (top ids, values, the prompt
        # token's rank); the prompt token's logprob is values[0] (its id first in ids).
        self.prompt_logprobs: list[tuple[list[int], list[float], int]] = []
        # The LoRA adapter this sample runs under (qiao/lora); None: the base model.
        self.lora_request = lora_request

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (no prefix-cache hit then)."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop after the last appended token; None while the request goes on."""
        if self.num_output_tokens == 0:
            return None
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def sort_key(self, use_priority: bool) -> tuple[int, int]:
        """Smaller runs first: (priority, arrival). Under fcfs every priority counts as 0."""
        return (self.priority if use_priority else 0, self.arrival_seq)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
