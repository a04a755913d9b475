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
    # Draft tokens to verify (speculative decoding): the last k of token_ids, proposed after the
    # request's last token; the runner samples all 1 + k positions and keeps the matching run.
    spec_token_ids: list[int] = field(default_factory=list)


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
    # Request id -> the tokens after its sampled token that a row verifying draft tokens also
    # produced, in order: as many as drafts were accepted (the accepted drafts after the first,
    # then the target's own token after them). E.g. drafts [7, 8, 9], target [7, 8, 5, 2]:
    # sampled 7, then [8, 5]. Every row with draft tokens has an entry, [] when none matched.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Request id -> (first prompt position covered, entries): the logprobs of prompt tokens
    # first+1, first+2, ... as `Request.prompt_logprobs` keeps them.
    prompt_logprobs: dict[str, tuple[int, list[tuple[list[int], list[float], int]]]] = field(
        default_factory=dict
    )
