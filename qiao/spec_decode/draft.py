"""Draft-model proposals: a second, smaller model with the same vocabulary proposes k tokens
greedily, with its own KV cache run by its own `ModelRunner` and `BlockManager`.

Each engine step, the requests about to decode are proposed for together: one draft forward
catches each request's draft cache up with its tokens (the prompt the first time; afterwards the
tokens accepted since, usually a few) and yields its first draft token; k - 1 more one-token
forwards yield the rest. Drafts are the draft model's argmax (q one-hot), so the target's
`verify` rule is exact for them. The draft cache keeps what still matches the request's tokens:
positions of rejected drafts are recomputed (their slots overwritten) at the next proposal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from qiao.sampling_params import SamplingParams
from qiao.step import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from qiao.engine.block_manager import BlockManager
    from qiao.engine.request import Request
    from qiao.runner.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class DraftSequence:
    """The draft model's copy of one request, as its runner and block manager read a request:
    the tokens its cache was computed for (ending with the last proposals) and how many."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    params: SamplingParams = field(default_factory=lambda: _GREEDY)
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    grammar: Any = None
    lora_request: Any = None
    needs_prompt_logprobs: bool = False
    block_hashes: list[bytes] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)  # greedy: read by nothing

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftProposer:
    def __init__(
        self, runner: ModelRunner, block_manager: BlockManager, num_speculative_tokens: int
    ) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.num_speculative_tokens = num_speculative_tokens
        self.sequences: dict[str, DraftSequence] = {}

    def propose_batch(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        """Draft tokens for each request (at most min(k, room) each); the draft state of
        requests not in `requests` is dropped (finished, preempted or not decoding)."""
        wanted = {r.request_id for r in requests}
        for request_id in [rid for rid in self.sequences if rid not in wanted]:
            self._drop(request_id)
        drafts: list[list[int]] = [[] for _ in requests]
        limits = [min(self.num_speculative_tokens, room) for room in rooms]
        active = [
            i for i, r in enumerate(requests) if limits[i] > 0 and self._prepare(r, limits[i])
        ]
        first = True
        while active:
            items = [self._scheduled(requests[i].request_id, first) for i in active]
            out = self.runner.execute(
                SchedulerOutput(
                    scheduled=items, num_scheduled_tokens=sum(len(s.token_ids) for s in items)
                )
            )
            for i, item, token in zip(active, items, out.sampled_token_ids, strict=True):
                sequence = self.sequences[requests[i].request_id]
                sequence.num_computed_tokens += len(item.token_ids)
                sequence.all_token_ids.append(token)
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < limits[i]]
            first = False
        return drafts

    def _prepare(self, request: Request, k: int) -> bool:
        """Bring the draft copy up to the request's tokens and allocate its slots for this
        proposal (the tokens to catch up and k - 1 drafts); False when the pool is full."""
        sequence = self.sequences.get(request.request_id)
        if sequence is None:
            sequence = DraftSequence(request.request_id, [])
            self.sequences[request.request_id] = sequence
        tokens = request.all_token_ids
        kept = _common_prefix(sequence.all_token_ids, tokens, sequence.num_computed_tokens, k + 1)
        sequence.num_computed_tokens = min(kept, len(tokens) - 1)
        sequence.all_token_ids = list(tokens)
        num_new = len(tokens) - sequence.num_computed_tokens + k - 1
        if self.block_manager.allocate_slots(sequence, num_new):
            return True
        self._drop(request.request_id)
        return False

    def _scheduled(self, request_id: str, first: bool) -> ScheduledRequest:
        """This forward's share of a sequence: its uncomputed tokens (the first forward), else
        its last draft token."""
        sequence = self.sequences[request_id]
        start = sequence.num_computed_tokens
        return ScheduledRequest(
            request=sequence,  # type: ignore[arg-type]  # read as a Request by the runner
            token_ids=sequence.all_token_ids[start:] if first else sequence.all_token_ids[-1:],
            num_computed_tokens=start,
            block_ids=self.block_manager.get_block_ids(request_id),
            sample=True,
        )

    def _drop(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id)
        self.block_manager.free(sequence)  # type: ignore[arg-type]


def _common_prefix(cached: list[int], tokens: list[int], num_computed: int, span: int) -> int:
    """How many of the first `num_computed` cached tokens still equal the request's. Tokens are
    only ever appended, so only the last `span` cached ones (the previous proposals) can differ.

    E.g. cached [1, 2, 3, 7, 8] (all computed), tokens [1, 2, 3, 7, 9, 4] -> 4.
    """
    limit = min(num_computed, len(tokens))
    start = max(0, limit - span)
    a = np.asarray(cached[start:limit], dtype=np.int64)
    b = np.asarray(tokens[start:limit], dtype=np.int64)
    mismatch = np.flatnonzero(a != b)
    return start + int(mismatch[0]) if len(mismatch) else limit
