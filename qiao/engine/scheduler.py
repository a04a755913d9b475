"""Continuous batching: which requests compute how many tokens in the next step.

Pure bookkeeping: no tensors, no device calls. Each step hands out tokens under a budget
(`max_num_batched_tokens`) to close every request's gap `num_tokens - num_computed_tokens`:
running requests first (a decode needs 1; a chunked prefill its next chunk), then waiting ones
in policy order while sequences, tokens and KV blocks last. When a running request cannot get a
block, the lowest-priority, youngest running request is preempted: its blocks are freed and it
goes back to waiting, to be recomputed later (its prefix is usually still cached).

After a step ran out of memory (`cap_step`), steps take at most the tokens and the sequences of
the largest part of it that ran (a step's memory grows with both: activations with its tokens,
logits with its sequences), and running requests past that many sequences are preempted. The
cap doubles back after `CAP_GROWTH_STEPS` steps that ran, until it is the configured budget
again; each out-of-memory step while a cap holds doubles that wait (up to
`MAX_CAP_GROWTH_STEPS`), so a size that keeps failing is tried ever more rarely.
"""

from __future__ import annotations

import heapq
import itertools
import time

from qiao.config import SchedulerConfig
from qiao.engine.block_manager import BlockManager
from qiao.engine.request import Request, RequestStatus
from qiao.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

# Steps that run under an out-of-memory cap before it doubles (the wait doubles with each
# out-of-memory step under a cap, up to the second figure).
CAP_GROWTH_STEPS = 32
MAX_CAP_GROWTH_STEPS = 1024


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.use_priority = config.policy == "priority"
        self.requests: dict[str, Request] = {}
        # (sort key, tie-break, request): the smallest key is admitted first; the n samples of
        # one prompt share a key and keep their insertion order.
        self.waiting: list[tuple[tuple[int, int, int], int, Request]] = []
        self._tiebreak = itertools.count()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_appended_tokens = 0  # output tokens the last update() appended
        # Tokens and sequences per step after an out-of-memory step (None: as configured).
        self.step_token_cap: int | None = None
        self.step_seq_cap: int | None = None
        self._steps_under_cap = 0
        self._cap_growth_steps = CAP_GROWTH_STEPS
        self._background_tokens = 0  # background tokens scheduled in the step being built
        # Tokens per step that adaptive batching chose (`set_token_budget`; None: as configured).
        self.adaptive_token_budget: int | None = None
        # (time, tokens, sequences) of the last step with online work (`background_hold_s`).
        self._last_foreground: tuple[float, int, int] | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to compute (O(waiting); the queue is bounded)."""
        return sum(r.num_tokens - r.num_computed_tokens for _, _, r in self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def cap_step(self, max_tokens: int, max_seqs: int) -> None:
        """Steps take at most `max_tokens` tokens and `max_seqs` sequences for a while (a larger
        step ran out of memory)."""
        tokens = max(1, max_tokens) if max_tokens < self.config.max_num_batched_tokens else None
        seqs = max(1, max_seqs) if max_seqs < self.config.max_num_seqs else None
        if tokens is None and seqs is None:
            return
        if self.step_token_cap is not None or self.step_seq_cap is not None:
            # Out of memory again under a cap: the size it grew to fails, so wait longer.
            self._cap_growth_steps = min(2 * self._cap_growth_steps, MAX_CAP_GROWTH_STEPS)
        self.step_token_cap, self.step_seq_cap = tokens, seqs
        self._steps_under_cap = 0

    def set_token_budget(self, max_tokens: int | None) -> None:
        """Steps take at most `max_tokens` tokens (adaptive batching's choice, below the
        configured budget; None: the configured one), but never fewer than the running
        sequences, so a smaller budget holds prefill chunks back, not decodes."""
        self.adaptive_token_budget = max_tokens

    def is_background(self, request: Request) -> bool:
        threshold = self.config.background_priority
        return threshold is not None and request.priority >= threshold

    def _key(self, request: Request) -> tuple[int, int, int]:
        """Smaller is admitted first and preempted last: foreground before background, then
        the policy's order (background requests always by priority: a batch's own priority)."""
        background = self.is_background(request)
        return (int(background), *request.sort_key(self.use_priority or background))

    def _foreground_waiting(self) -> int:
        """Online requests waiting (the heap keeps them ahead of every background one)."""
        if self.config.background_priority is None:
            return len(self.waiting)
        return sum(1 for _, _, r in self.waiting if not self.is_background(r))

    def _background_limits(
        self, full_budget: int, max_seqs: int, foreground_tokens: int, foreground_seqs: int
    ) -> tuple[int, int]:
        """(sequences, tokens) background requests may take in this step: all of them while no
        other request runs or waits (the spare capacity), else at most their share of what the
        online requests took in it (at least one of each, so a batch never stops for good).
        Within `background_hold_s` of the last step with online work, its figures still hold."""
        waiting = self.waiting and not self.is_background(self.waiting[0][2])
        if foreground_seqs or waiting:
            self._last_foreground = (time.monotonic(), foreground_tokens, foreground_seqs)
        elif (
            self._last_foreground is not None
            and time.monotonic() - self._last_foreground[0] < self.config.background_hold_s
        ):
            _, foreground_tokens, foreground_seqs = self._last_foreground
        else:
            return max_seqs, full_budget
        share = self.config.background_share
        return max(1, int(share * foreground_seqs)), max(1, int(share * foreground_tokens))

    def _make_room_for_foreground(
        self, max_seqs: int, scheduled: dict[str, ScheduledRequest], out: SchedulerOutput
    ) -> None:
        """Online requests wait while background work holds the seats they need (it took them
        while there was nothing else): preempt the youngest background requests to free them."""
        if self.config.background_priority is None:
            return
        needed = self._foreground_waiting()
        while needed and len(self.running) + needed > max_seqs:
            background = [r for r in self.running if self.is_background(r)]
            if not background:
                return
            self._preempt(max(background, key=self._key), scheduled, out)

    def schedule(self) -> SchedulerOutput:
        """Online (foreground) requests first: the running ones, then the waiting ones; then
        background requests within what `_background_limits` leaves them. Without a background
        priority every request is foreground."""
        out = SchedulerOutput()
        full_budget, max_seqs = self._step_budget()
        budget = full_budget
        self._background_tokens = 0
        scheduled: dict[str, ScheduledRequest] = {}
        while len(self.running) > min(budget, max_seqs):  # under an out-of-memory cap
            victim = max(self.running, key=self._key)
            self._preempt(victim, scheduled, out)
        self._make_room_for_foreground(max_seqs, scheduled, out)
        budget, foreground_preempted = self._schedule_running(
            budget, scheduled, out, background=False
        )
        if not foreground_preempted:
            budget = self._admit_waiting(budget, scheduled, out, max_seqs, None)
        if self.config.background_priority is not None:
            foreground = [s for s in scheduled.values() if not self.is_background(s.request)]
            limits = self._background_limits(
                full_budget, max_seqs, sum(len(s.token_ids) for s in foreground), len(foreground)
            )
            budget, _ = self._schedule_running(
                budget, scheduled, out, background=True, limits=limits
            )
            if not out.preempted_req_ids:
                budget = self._admit_waiting(budget, scheduled, out, max_seqs, limits)
        out.scheduled = list(scheduled.values())
        out.num_scheduled_tokens = full_budget - budget
        return out

    def _schedule_running(
        self,
        budget: int,
        scheduled: dict[str, ScheduledRequest],
        out: SchedulerOutput,
        background: bool,
        limits: tuple[int, int] | None = None,
    ) -> tuple[int, bool]:
        """Give running requests of one kind (online or background, within `limits`) their next
        tokens. Returns the budget left and whether a request of this kind was preempted."""
        seq_limit, token_limit = limits or (0, 0)
        num_seqs = 0
        preempted = False
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING or self.is_background(request) != background:
                continue  # preempted earlier in this loop, or the other kind
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if background:
                num_new = min(num_new, token_limit - self._background_tokens)
                if num_new <= 0 or num_seqs >= seq_limit:
                    break  # the background share of this step is spent: the rest wait
            allowance = min(budget, token_limit - self._background_tokens) if background else budget
            num_new += _num_drafts(request, allowance)
            before = len(out.preempted_req_ids)
            allocated, given_back = self._allocate_or_preempt(request, num_new, scheduled, out)
            victims = out.preempted_req_ids[before:]
            preempted |= any(self.is_background(self.requests[r]) == background for r in victims)
            # Victims scheduled earlier in this loop hand their tokens back to the budget.
            budget += given_back
            if not allocated:
                continue
            scheduled[request.request_id] = self._make_scheduled(request, num_new)
            budget -= num_new
            num_seqs += 1
            if background:
                self._background_tokens += num_new
        return budget, preempted

    def _step_budget(self) -> tuple[int, int]:
        """(tokens, sequences) this step may take: the configured ones, or an out-of-memory cap
        (which doubles back after the growth wait)."""
        budget, max_seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        if self.adaptive_token_budget is not None:
            budget = min(budget, max(self.adaptive_token_budget, len(self.running)))
        if self.step_token_cap is None and self.step_seq_cap is None:
            return budget, max_seqs
        self._steps_under_cap += 1
        if self._steps_under_cap > self._cap_growth_steps:
            self._steps_under_cap = 1
            if self.step_token_cap is not None:
                self.step_token_cap *= 2
                if self.step_token_cap >= budget:
                    self.step_token_cap = None
            if self.step_seq_cap is not None:
                self.step_seq_cap *= 2
                if self.step_seq_cap >= max_seqs:
                    self.step_seq_cap = None
            if self.step_token_cap is None and self.step_seq_cap is None:
                self._cap_growth_steps = CAP_GROWTH_STEPS
                return budget, max_seqs
        return min(self.step_token_cap or budget, budget), self.step_seq_cap or max_seqs

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish token-level stops.

        Returns the requests that received a token this step (finished ones included).
        """
        spec = runner_output.spec_token_ids
        for item in scheduler_output.scheduled:
            # Rejected draft positions stay uncomputed: later steps overwrite their slots.
            num_rejected = len(item.spec_token_ids) - len(spec.get(item.request.request_id, ()))
            item.request.num_computed_tokens += len(item.token_ids) - num_rejected
        updated = []
        self.num_appended_tokens = 0
        for req_id, token_id in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            updated.append(request)
            # A verifying step's accepted run ends at the first token-level stop in it, as
            # plain decoding would.
            for token in (token_id, *spec.get(req_id, ())):
                request.append_output_token(token)
                self.num_appended_tokens += 1
                status = request.check_stop()
                if status is not None:
                    self._finish(request, status)
                    break
        return updated

    def fail_request(self, req_id: str) -> None:
        """End a request whose step failed: its blocks are freed, and the ones it had offered to
        the prefix cache in that step (never written) are withdrawn."""
        request = self.requests.get(req_id)
        if request is None or request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting = [entry for entry in self.waiting if entry[2] is not request]
            heapq.heapify(self.waiting)
        request.status = RequestStatus.FINISHED_ABORTED
        self.block_manager.free(request, request.num_computed_tokens)
        del self.requests[req_id]

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        """End requests wherever they are (abort, stop string, deadline); blocks free now."""
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)

    def _allocate_or_preempt(
        self,
        request: Request,
        num_new: int,
        scheduled: dict[str, ScheduledRequest],
        out: SchedulerOutput,
    ) -> tuple[bool, int]:
        """Allocate `num_new` slots for `request`, preempting the lowest-priority, youngest
        running requests until it fits. Returns (allocated, tokens given back by victims that
        were already scheduled in this step)."""
        given_back = 0
        while not self.block_manager.allocate_slots(request, num_new):
            victim = max(self.running, key=self._key)
            given_back += self._preempt(victim, scheduled, out)
            if victim is request:
                return False, given_back
        return True, given_back

    def _preempt(
        self, victim: Request, scheduled: dict[str, ScheduledRequest], out: SchedulerOutput
    ) -> int:
        """Send a running request back to waiting; returns the tokens it had been scheduled in
        this step (its entry is dropped, so they go back to the budget)."""
        dropped = scheduled.pop(victim.request_id, None)
        self.running.remove(victim)
        # Blocks allocated for the dropped share were never written: keep them out of the cache.
        self.block_manager.free(victim, victim.num_computed_tokens if dropped else None)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_req_ids.append(victim.request_id)
        self._push_waiting(victim)
        return 0 if dropped is None else len(dropped.token_ids)

    def _admit_waiting(
        self,
        budget: int,
        scheduled: dict[str, ScheduledRequest],
        out: SchedulerOutput,
        max_seqs: int,
        limits: tuple[int, int] | None,
    ) -> int:
        """Admit waiting requests in heap order: online ones when `limits` is None (seats and
        blocks that background requests hold are taken back for them), background ones within
        `limits`."""
        background_pass = limits is not None
        seq_limit, token_limit = limits or (0, 0)
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            request = self.waiting[0][2]
            background = self.is_background(request)
            if background != background_pass:
                break  # every request behind it is background too
            allowance = budget
            if background:
                running = sum(1 for r in self.running if self.is_background(r))
                allowance = min(budget, token_limit - self._background_tokens)
                if running >= seq_limit or allowance <= 0:
                    break
            num_new = self._allocate_prompt(request, allowance, scheduled, out)
            if num_new is None:
                break
            heapq.heappop(self.waiting)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = self._make_scheduled(request, num_new)
            budget -= num_new
            if background:
                self._background_tokens += num_new
        return budget

    def _allocate_prompt(
        self,
        request: Request,
        allowance: int,
        scheduled: dict[str, ScheduledRequest],
        out: SchedulerOutput,
    ) -> int | None:
        """Take cached prefix blocks and slots for a waiting request's next chunk (at most
        `allowance` tokens); an online request may preempt background ones for the slots.
        Returns the tokens scheduled, or None when it cannot start now."""
        while True:
            if request.needs_prompt_logprobs:  # every prompt position must be computed
                hits, num_hit_tokens = [], 0
            else:
                hits, num_hit_tokens = self.block_manager.get_computed_blocks(request)
            request.num_computed_tokens = num_hit_tokens
            num_new = request.num_tokens - num_hit_tokens
            if num_new > allowance:
                if not self.config.enable_chunked_prefill:
                    request.num_computed_tokens = 0
                    return None
                num_new = allowance
            if self.block_manager.allocate_slots(request, num_new, hits):
                return num_new
            request.num_computed_tokens = 0
            background = [r for r in self.running if self.is_background(r)]
            if self.is_background(request) or not background:
                return None
            self._preempt(max(background, key=self._key), scheduled, out)

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        # Tokens past the last known one are draft tokens to verify (`_num_drafts`).
        drafts = request.spec_token_ids[: max(0, start + num_new - request.num_tokens)]
        return ScheduledRequest(
            request=request,
            token_ids=request.all_token_ids[start : start + num_new] + drafts,
            num_computed_tokens=start,
            block_ids=self.block_manager.get_block_ids(request.request_id),
            sample=start + num_new - len(drafts) == request.num_tokens,
            spec_token_ids=drafts,
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting = [entry for entry in self.waiting if entry[2] is not request]
            heapq.heapify(self.waiting)
        request.status = status
        self.block_manager.free(request)
        del self.requests[request.request_id]

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self.waiting, (self._key(request), next(self._tiebreak), request))


def _num_drafts(request: Request, allowance: int) -> int:
    """Draft tokens a decode verifies this step (speculative decoding): the proposed ones, within
    the step's `allowance` of tokens (its next token takes one) and the request's token limit."""
    if request.num_tokens - request.num_computed_tokens != 1:
        return 0
    room = request.max_total_tokens - request.num_tokens - 1
    return max(0, min(len(request.spec_token_ids), allowance - 1, room))
