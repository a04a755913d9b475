"""The engine's side of speculative decoding: which requests speculate, their next proposals,
and the counters the metrics export.

After each step, every running request about to decode gets its draft tokens
(`Request.spec_token_ids`); the scheduler gives it 1 + k tokens when the budget allows. A request
never speculates while it asks for logprobs (the runner reports them for one token per step) or
follows a grammar (its matcher advances one token at a time); those decode one token per step,
as without speculation. Penalties, `min_tokens`, temperature, top-k/top-p/min-p and seeds all
speculate: verification samples every position under the request's own state (`verify`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qiao.config import SpeculativeConfig
from qiao.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from qiao.engine.request import Request
    from qiao.spec_decode.draft import DraftProposer
    from qiao.step import ModelRunnerOutput, SchedulerOutput


@dataclass
class SpecDecodeStats:
    """Cumulative counts, as vLLM's `vllm:spec_decode_*` counters."""

    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Accepted drafts at each position 0..k-1 (position j accepted implies j - 1 was).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, int | list[int]]:
        """The engine's `stats()` entries."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step: 1 (the target's own) + accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def can_speculate(request: Request) -> bool:
    """Whether verification can produce this request's tokens exactly (see the module doc)."""
    return request.params.logprobs is None and request.grammar is None


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftProposer | None = None) -> None:
        """`draft`: the draft model's proposer (method "draft"), built by the engine."""
        self.config = config
        self.proposer: NgramProposer | DraftProposer = draft or NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.stats = SpecDecodeStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens
        )

    def after_step(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        running: Iterable[Request],
    ) -> None:
        """Count the step's verified drafts, then propose the running requests' next ones."""
        self._observe(scheduler_output, runner_output)
        ready: list[Request] = []
        rooms: list[int] = []
        for request in running:
            request.spec_token_ids = []
            # Only a request whose next step is a decode (its last token is the one gap)
            # proposes; a step never outgrows the request's token limit.
            room = request.max_total_tokens - request.num_tokens - 1
            if request.num_tokens - request.num_computed_tokens != 1 or room <= 0:
                continue
            if can_speculate(request):
                ready.append(request)
                rooms.append(room)
        # Called with no request too: a draft proposer then drops the state of finished ones.
        drafts = self.proposer.propose_batch(ready, rooms)
        for request, request_drafts in zip(ready, drafts, strict=True):
            request.spec_token_ids = request_drafts

    def _observe(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        stats = self.stats
        for item in scheduler_output.scheduled:
            num_drafts = len(item.spec_token_ids)
            if not num_drafts:
                continue
            accepted = runner_output.spec_token_ids.get(item.request.request_id)
            if accepted is None:
                continue  # the step did not run for it
            stats.num_drafts += 1
            stats.num_draft_tokens += num_drafts
            stats.num_accepted_tokens += len(accepted)
            for position in range(len(accepted)):
                stats.num_accepted_tokens_per_pos[position] += 1
