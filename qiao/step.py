"""The boundary between scheduling and execution: what to run this step, and what came out.

Two plain dataclasses (and the per-request entry of the first). The scheduler builds a
`SchedulerOutput`; the runner turns it into tensors and answers with a `ModelRunnerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qiao.engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    # Tokens to compute now: all_token_ids[num_computed_tokens : num_computed_tokens + len].
    token_ids: list[int]
    # Position of token_ids[0]; the tokens before it are in the cache already.
    num_computed_tokens: int
    # The request's whole block table after allocation.
    block_ids: list[int]
    # True when this chunk reaches the last known token: the runner samples the next one.
    sample: bool


@dataclass
class SchedulerOutput:
    """What to run this step, in batch order."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Sum of len(token_ids) over `scheduled`.
    num_scheduled_tokens: int = 0
    # Requests sent back to waiting during this schedule() call.
    preempted_req_ids: list[str] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """What came out of a step: one sampled token per request whose `sample` was set."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    # Per sampled row, when asked: (token ids, logprobs) with the sampled token first, then top-k.
    logprobs: list[tuple[list[int], list[float]] | None] | None = None
    # Per sampled row, when logprobs were asked: rank of the sampled token (1 = most likely).
    sampled_ranks: list[int] | None = None
    # Request id -> (first prompt position covered, entries): the logprobs of prompt tokens
    # first+1, first+2, ... as `Request.prompt_logprobs` keeps them.
    prompt_logprobs: dict[str, tuple[int, list[tuple[list[int], list[float], int]]]] = field(
        default_factory=dict
    )
