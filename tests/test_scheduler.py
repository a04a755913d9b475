"""Scheduler and block manager, driven with fabricated runner output (no model, no tensors)."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qiao.config import SchedulerConfig
from qiao.engine.block_manager import BlockManager
from qiao.engine.request import Request, RequestStatus
from qiao.engine.scheduler import CAP_GROWTH_STEPS, MAX_CAP_GROWTH_STEPS, Scheduler
from qiao.sampling_params import SamplingParams
from qiao.step import ModelRunnerOutput, SchedulerOutput

BLOCK = 4


def make_scheduler(
    num_blocks=64, max_num_seqs=8, budget=32, policy="fcfs", chunked=True, prefix=True
):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    return Scheduler(config, bm), bm


_seq = itertools.count()


def make_request(prompt, max_tokens=4, priority=0, req_id=None, eos=(0,)):
    n = next(_seq)
    return Request(
        req_id or f"r{n}",
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        seed=n,
        eos_token_ids=eos,
        max_total_tokens=len(prompt) + max_tokens,
        priority=priority,
        arrival_seq=n,
    )


def fake_run(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    rows = [s.request.request_id for s in out.scheduled if s.sample]
    return ModelRunnerOutput(req_ids=rows, sampled_token_ids=[token] * len(rows))


def step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    out = scheduler.schedule()
    scheduler.update(out, fake_run(out, token))
    scheduler.block_manager.check_invariants()
    return out


def test_decode_and_prefill_share_a_step_under_the_budget():
    sched, _bm = make_scheduler(budget=10)
    a = make_request(range(1, 5), max_tokens=8)
    sched.add_request(a)
    step(sched)  # a's prompt (4 tokens) -> a decodes from now on
    b = make_request(range(10, 30), max_tokens=2)
    sched.add_request(b)
    out = step(sched)
    counts = {s.request.request_id: len(s.token_ids) for s in out.scheduled}
    # a decodes 1 token; b's 20-token prompt is chunked to the remaining 9.
    assert counts == {a.request_id: 1, b.request_id: 9}
    assert out.num_scheduled_tokens == 10
    assert not next(s for s in out.scheduled if s.request is b).sample
    assert b.num_computed_tokens == 9 and b.num_output_tokens == 0


def test_finishes_on_length_and_eos_and_frees_blocks():
    sched, bm = make_scheduler()
    a = make_request([1, 2, 3], max_tokens=3)
    b = make_request([4, 5, 6], max_tokens=10, eos=(9,))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched, token=9)  # b emits EOS
    assert b.status == RequestStatus.FINISHED_STOPPED
    step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 3
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.has_unfinished_requests()


def test_prefix_cache_hit_skips_shared_blocks():
    sched, _bm = make_scheduler(num_blocks=64, budget=64)
    prefix = list(range(100, 116))  # 4 full blocks
    a = make_request(prefix + [1, 2], max_tokens=1)
    sched.add_request(a)
    step(sched)
    assert a.is_finished
    b = make_request(prefix + [3, 4, 5], max_tokens=1)
    sched.add_request(b)
    out = step(sched)
    assert b.num_cached_tokens == 16
    assert len(out.scheduled[0].token_ids) == 3


def test_same_step_siblings_share_prompt_blocks():
    sched, bm = make_scheduler(num_blocks=64, budget=64)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    reqs = [make_request(prompt, max_tokens=2) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    tables = [bm.get_block_ids(r.request_id) for r in reqs]
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]
    assert [r.num_cached_tokens for r in reqs] == [0, 12, 12]
    # 3 shared blocks + one private tail block each.
    assert bm.num_blocks - bm.num_free_blocks == 3 + 3


def test_preemption_youngest_first_and_resume():
    sched, bm = make_scheduler(num_blocks=4, budget=64)
    a = make_request([1, 2, 3, 4, 5, 6, 7], max_tokens=6)  # 2 blocks, grows to 4 blocks
    b = make_request([8, 9, 10, 11, 12, 13], max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    seen_preempt = False
    for _ in range(40):
        out = step(sched)
        seen_preempt |= b.request_id in out.preempted_req_ids
        assert a.request_id not in out.preempted_req_ids  # the older request is never the victim
        if not sched.has_unfinished_requests():
            break
    assert seen_preempt
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert bm.num_free_blocks == bm.num_blocks


def test_priority_policy_admits_and_preempts_by_priority():
    sched, _bm = make_scheduler(max_num_seqs=1, policy="priority")
    low = make_request([1, 2, 3], priority=5)
    high = make_request([4, 5, 6], priority=-1)
    sched.add_request(low)
    sched.add_request(high)
    out = step(sched)
    assert [s.request for s in out.scheduled] == [high]


def test_abort_anywhere_frees_blocks_in_the_same_step():
    sched, bm = make_scheduler(budget=8)
    running = make_request(list(range(1, 6)), max_tokens=10)
    chunking = make_request(list(range(1, 40)), max_tokens=10)
    waiting = make_request(list(range(50, 60)), max_tokens=10)
    for r in (running, chunking, waiting):
        sched.add_request(r)
    step(sched)
    step(sched)
    sched.finish_requests(
        [r.request_id for r in (running, chunking, waiting)], RequestStatus.FINISHED_ABORTED
    )
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert sched.num_running == 0 and sched.num_waiting == 0


def test_no_chunking_waits_for_budget():
    sched, _ = make_scheduler(budget=8, chunked=False)
    sched.add_request(make_request(list(range(1, 12))))
    out = sched.schedule()
    assert out.scheduled == []


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add_shared", "step", "abort", "stop"]),
        st.integers(min_value=1, max_value=40),
        st.integers(min_value=0, max_value=10**6),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=ACTIONS,
    num_blocks=st.integers(min_value=6, max_value=20),
    budget=st.integers(min_value=4, max_value=48),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_block_accounting_under_any_mix(actions, num_blocks, budget, policy):
    sched, bm = make_scheduler(num_blocks=num_blocks, max_num_seqs=4, budget=budget, policy=policy)
    live: list[Request] = []
    shared_prefix = list(range(200, 216))
    for kind, size, pick in actions:
        if kind in ("add", "add_shared"):
            prompt = (shared_prefix if kind == "add_shared" else []) + [
                1 + i for i in range(size % 17 + 1)
            ]
            max_tokens = size % 9 + 1
            if bm.blocks_needed(len(prompt) + max_tokens) > num_blocks:
                continue  # the engine refuses such a request up front
            r = make_request(prompt, max_tokens=max_tokens, priority=pick % 3)
            sched.add_request(r)
            live.append(r)
        elif kind == "step":
            step(sched, token=3 + pick % 5)
        elif live:
            r = live[pick % len(live)]
            status = (
                RequestStatus.FINISHED_ABORTED
                if kind == "abort"
                else RequestStatus.FINISHED_STOPPED
            )
            sched.finish_requests([r.request_id], status)
        bm.check_invariants()
        used = sum(1 for b in bm.blocks if b.ref_cnt > 0)
        assert used + bm.num_free_blocks == bm.num_blocks
        for r in live:
            if r.is_finished:
                assert r.request_id not in bm.req_to_blocks
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks
    for r in live:
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.params.max_tokens


def _run_to_end(sched: Scheduler, request: Request, token: int = 7) -> list[int]:
    """Run one request alone to the end; its block ids."""
    sched.add_request(request)
    out = step(sched, token)
    blocks = list(out.scheduled[0].block_ids)
    while sched.num_running or sched.num_waiting:
        out = step(sched, token)
        if out.scheduled:
            blocks = list(out.scheduled[0].block_ids)
    return blocks


def test_an_out_of_memory_cap_preempts_down_to_it_then_grows_back():
    sched, bm = make_scheduler(num_blocks=64, max_num_seqs=8, budget=32)
    requests = [make_request([1, 2, 3], max_tokens=200, eos=()) for _ in range(8)]
    for request in requests:
        sched.add_request(request)
    step(sched)
    assert sched.num_running == 8
    sched.cap_step(3, 8)  # 3 tokens: 3 decodes
    out = step(sched)
    # The youngest five go back to waiting; the oldest three decode.
    assert [s.request for s in out.scheduled] == requests[:3]
    assert sorted(out.preempted_req_ids) == sorted(r.request_id for r in requests[3:])
    assert all(r.status == RequestStatus.PREEMPTED for r in requests[3:])
    sizes = [step(sched).num_scheduled_tokens for _ in range(CAP_GROWTH_STEPS * 3)]
    assert max(sizes[: CAP_GROWTH_STEPS - 1]) <= 3
    assert max(sizes[CAP_GROWTH_STEPS : 2 * CAP_GROWTH_STEPS - 1]) <= 6
    assert sched.step_token_cap is None or sched.step_token_cap > 6
    # Back to the full budget: every request runs again and finishes.
    while sched.has_unfinished_requests():
        step(sched)
    assert all(r.num_output_tokens == 200 for r in requests)
    assert bm.num_free_blocks == bm.num_blocks


def test_an_out_of_memory_cap_limits_sequences_and_waits_longer_when_it_fails_again():
    sched, bm = make_scheduler(num_blocks=64, max_num_seqs=8, budget=32)
    requests = [make_request([1, 2, 3], max_tokens=150, eos=()) for _ in range(8)]
    for request in requests:
        sched.add_request(request)
    step(sched)
    sched.cap_step(32, 2)  # a part of 2 sequences ran: tokens are not what limits
    out = step(sched)
    assert [s.request for s in out.scheduled] == requests[:2]
    assert sorted(out.preempted_req_ids) == sorted(r.request_id for r in requests[2:])
    rows = [len(step(sched).scheduled) for _ in range(CAP_GROWTH_STEPS - 1)]
    assert max(rows) == 2  # preempted requests are not admitted past the cap
    assert len(step(sched).scheduled) == 4  # the wait is over: the cap doubled
    # 4 sequences run out of memory too: back to 2, and the next doubling waits twice as long.
    sched.cap_step(32, 2)
    rows = [len(step(sched).scheduled) for _ in range(2 * CAP_GROWTH_STEPS)]
    assert max(rows) == 2
    assert len(step(sched).scheduled) == 4
    while sched.has_unfinished_requests():
        step(sched)
    assert all(r.num_output_tokens == 150 for r in requests)
    assert bm.num_free_blocks == bm.num_blocks
    # Fully lifted, the wait is back to its start.
    assert sched.step_seq_cap is None and sched._cap_growth_steps == CAP_GROWTH_STEPS


def test_freed_blocks_are_reused_before_fresh_ones():
    """Without prefix caching nothing is worth keeping: one request after another keeps using the
    same blocks, so the memory touched follows the load, not the pool's size."""
    sched, bm = make_scheduler(num_blocks=64, prefix=False)
    first = _run_to_end(sched, make_request(range(1, 9), max_tokens=4))
    for offset in range(5):
        again = _run_to_end(sched, make_request(range(20 + offset, 28 + offset), max_tokens=4))
        assert sorted(again) == sorted(first)
    assert bm.next_fresh == len(first) and bm.num_free_blocks == 64


def test_prefix_cache_keeps_its_reserve_then_reuses_the_oldest():
    sched, _ = make_scheduler(num_blocks=64)
    assert sched.block_manager.cache_reserve == 64  # default: the whole pool is prefix cache
    bm = BlockManager(64, BLOCK, enable_prefix_caching=True, cache_reserve=8)
    sched = Scheduler(sched.config, bm)
    # Distinct 8-token prompts: each request holds 3 blocks, cached once full.
    prompts = [list(range(100 * i + 1, 100 * i + 9)) for i in range(8)]
    for prompt in prompts:
        _run_to_end(sched, make_request(prompt, max_tokens=4))
    # Freed, cached blocks pile up past the reserve (8), then the oldest are evicted rather than
    # fresh blocks touched: 14 at most instead of 24 (fresh first).
    assert len(bm.free_queue) <= bm.cache_reserve + 3
    assert bm.next_fresh <= bm.cache_reserve + 2 * 3
    # The most recent prompts' prefixes are still cached; the oldest one's are not.
    newest = make_request(prompts[-1] + [5], max_tokens=1)
    assert bm.get_computed_blocks(newest)[1] == 8
    oldest = make_request(prompts[0] + [5], max_tokens=1)
    assert bm.get_computed_blocks(oldest)[1] == 0
    bm.check_invariants()


def test_fresh_blocks_are_used_when_the_free_queue_holds_only_the_reserve():
    sched, bm = make_scheduler(num_blocks=64, budget=64, max_num_seqs=16)
    # Many requests at once need more blocks than have ever been freed: fresh ones, in order.
    requests = [make_request(range(10 * i + 1, 10 * i + 9), max_tokens=2) for i in range(12)]
    for request in requests:
        sched.add_request(request)
    out = step(sched)
    ids = sorted(b for s in out.scheduled for b in s.block_ids)
    assert ids == list(range(len(ids))) and bm.next_fresh == len(ids)


# --- a randomized run against "the model": every request ends as it would alone ----------------

VOCAB = 23
EOS = 0


class KVModel:
    """A fake model that reads its context from the paged cache, as attention does.

    The K/V "written" at position p mixes the token at p with the values at every position
    before it, each read through the request's block table; the next token is the last value
    mod VOCAB. A position read before it was written, a stale block from another request, or a
    prefix-cache hit on a block that was never computed changes the values, and with them every
    later token.
    """

    def __init__(self, num_blocks: int) -> None:
        self.slots: list[list[int | None]] = [[None] * BLOCK for _ in range(num_blocks)]

    def forget(self, block_id: int) -> None:
        """A block handed out for new content holds anything: read unwritten, it fails."""
        self.slots[block_id] = [None] * BLOCK

    def _context(self, block_ids: list[int], length: int) -> list[int]:
        values = [self.slots[block_ids[pos // BLOCK]][pos % BLOCK] for pos in range(length)]
        assert None not in values, f"position {values.index(None)} read before it was written"
        return values  # type: ignore[return-value]

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        rows, tokens = [], []
        # Batch order: a block shared with a request earlier in the step is written before it
        # is read, as the runner writes every layer's K/V before attention reads it.
        for s in out.scheduled:
            value = 0
            for j, token in enumerate(s.token_ids):
                pos = s.num_computed_tokens + j
                value = attend(self._context(s.block_ids, pos), token)
                self.slots[s.block_ids[pos // BLOCK]][pos % BLOCK] = value
            if s.sample:
                rows.append(s.request.request_id)
                tokens.append(value % VOCAB)
        return ModelRunnerOutput(req_ids=rows, sampled_token_ids=tokens)


class ForgetfulBlockManager(BlockManager):
    """Tells the model when a block is handed out for new content (not as a prefix hit)."""

    def __init__(self, *args, model: KVModel, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model = model

    def _pop_free(self):
        block = super()._pop_free()
        self.model.forget(block.block_id)
        return block


def attend(context: list[int], token: int) -> int:
    value = token * 7919 + len(context)
    for previous in context:
        value = (value * 1_000_003 + previous) % (2**31 - 1)
    return value


def alone(prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens a request generates with the whole machine to itself (no cache at all)."""
    values: list[int] = []
    for token in prompt:
        values.append(attend(values, token))
    out: list[int] = []
    while True:
        token = values[-1] % VOCAB
        out.append(token)
        if len(out) >= params.min_tokens and not params.ignore_eos and token == EOS:
            return out
        if len(out) >= params.max_tokens:
            return out
        values.append(attend(values, token))


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """The scheduler's invariants after schedule()."""
    config = sched.config
    lengths = [len(s.token_ids) for s in out.scheduled]
    assert out.num_scheduled_tokens == sum(lengths) <= config.max_num_batched_tokens
    assert all(n > 0 for n in lengths)
    ids = [s.request.request_id for s in out.scheduled]
    assert len(set(ids)) == len(ids) <= config.max_num_seqs
    assert not set(ids) & set(out.preempted_req_ids), "a preempted request was scheduled"
    assert len(sched.running) <= config.max_num_seqs
    bm = sched.block_manager
    for s in out.scheduled:
        r = s.request
        assert r.status == RequestStatus.RUNNING and r in sched.running
        assert s.num_computed_tokens == r.num_computed_tokens
        assert (
            s.token_ids
            == r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + len(s.token_ids)]
        )
        assert s.sample == (r.num_computed_tokens + len(s.token_ids) == r.num_tokens)
        assert len(s.block_ids) >= bm.blocks_needed(r.num_computed_tokens + len(s.token_ids))
        assert s.block_ids == bm.get_block_ids(r.request_id)
    for _, _, r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.request_id not in bm.req_to_blocks
    bm.check_invariants()


PROMPTS = st.lists(st.integers(min_value=1, max_value=VOCAB - 1), min_size=1, max_size=14)
EVENTS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.booleans(),  # start with the shared prefix
            PROMPTS,
            st.integers(min_value=1, max_value=3),  # n
            st.integers(min_value=1, max_value=12),  # max_tokens
            st.integers(min_value=0, max_value=2),  # priority
            st.booleans(),  # ignore_eos
        ),
        st.tuples(st.just("steps"), st.integers(min_value=1, max_value=4)),
        st.tuples(st.just("abort"), st.integers(min_value=0, max_value=10**6)),
        st.tuples(
            st.just("out of memory"),
            st.integers(min_value=1, max_value=6),
            st.integers(min_value=1, max_value=4),
        ),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=EVENTS,
    num_blocks=st.integers(min_value=4, max_value=12),
    budget=st.integers(min_value=1, max_value=24),
    max_num_seqs=st.integers(min_value=1, max_value=6),
    policy=st.sampled_from(["fcfs", "priority"]),
    chunked=st.booleans(),
    prefix=st.booleans(),
)
def test_tiny_pool_runs_every_request_as_it_would_alone(
    events, num_blocks, budget, max_num_seqs, policy, chunked, prefix
):
    """Preemption (of requests already scheduled in the step too), chunked prefill, prefix hits,
    n > 1 siblings, priorities, aborts and out-of-memory step caps, on a pool that holds only a few requests: after every
    schedule() the invariants hold, and each request that was not aborted finishes with exactly
    the tokens it generates alone."""
    if not chunked:
        budget = max(budget, 14 + 12 + 8)  # without chunking a prompt must fit one step
    model = KVModel(num_blocks)
    bm = ForgetfulBlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix, model=model)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    sched = Scheduler(config, bm)
    expected: dict[str, list[int]] = {}
    requests: dict[str, Request] = {}
    arrivals = itertools.count()

    def run_steps(count: int) -> None:
        for _ in range(count):
            if not sched.has_unfinished_requests():
                return
            out = sched.schedule()
            check_step(sched, out)
            sched.update(out, model.run(out))
            bm.check_invariants()
            # Once a step ran, every block the prefix cache names holds all its K/V.
            for block in bm.cached.values():
                assert None not in model.slots[block.block_id], "cached block never written"

    for event in events:
        if event[0] == "add":
            _, shared, prompt, n, max_tokens, priority, ignore_eos = event
            prompt = ([5, 6, 7, 8, 9, 10, 11, 12] if shared else []) + prompt
            if bm.blocks_needed(len(prompt) + max_tokens) > num_blocks:
                continue  # the engine refuses such a request up front
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
            seq = next(arrivals)
            for i in range(n):
                request = Request(
                    f"q{seq}#{i}",
                    list(prompt),
                    params,
                    seed=seq,
                    eos_token_ids=(EOS,),
                    max_total_tokens=len(prompt) + max_tokens,
                    priority=priority,
                    arrival_seq=seq,
                )
                sched.add_request(request)
                requests[request.request_id] = request
                expected[request.request_id] = alone(prompt, params)
        elif event[0] == "steps":
            run_steps(event[1])
        elif event[0] == "out of memory":
            sched.cap_step(event[1], event[2])
        else:
            live = [r for r in requests.values() if not r.is_finished]
            if live:
                victim = live[event[1] % len(live)]
                sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
                check_step(sched, SchedulerOutput())
    # Enough for the work, plus an out-of-memory cap lifting at its longest waits (at most 5
    # doublings of a cap on these budgets, each after at most MAX_CAP_GROWTH_STEPS steps).
    run_steps(2000 + 5 * MAX_CAP_GROWTH_STEPS)
    assert not sched.has_unfinished_requests(), "the scheduler stopped making progress"
    assert bm.num_free_blocks == bm.num_blocks
    for req_id, request in requests.items():
        if request.status == RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == expected[req_id][: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected[req_id], req_id


def _background_scheduler(share: float, max_num_seqs: int = 4, budget: int = 32) -> Scheduler:
    bm = BlockManager(256, BLOCK, enable_prefix_caching=False)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        background_priority=10,
        background_share=share,
    )
    return Scheduler(config, bm)


def _background(out) -> list:
    return [s for s in out.scheduled if s.request.priority == 10]


def test_background_requests_use_spare_capacity_and_yield_to_online_ones():
    sched = _background_scheduler(0.5, max_num_seqs=8, budget=64)
    batch = [make_request([1, 2, 3, 4], max_tokens=50, priority=10) for _ in range(10)]
    for request in batch:
        sched.add_request(request)
    out = step(sched)
    assert len(out.scheduled) == 8  # nothing else to run: the batch takes every seat
    # Online requests arriving after the batch: background requests are preempted to seat them
    # in the same step, and they run ahead of the waiting batch lines (fcfs notwithstanding).
    online = [make_request([5, 6, 7, 8], max_tokens=8) for _ in range(4)]
    for request in online:
        sched.add_request(request)
    out = step(sched)
    assert len(out.preempted_req_ids) == 4
    assert {r.request_id for r in online} <= {s.request.request_id for s in out.scheduled}
    # Beside them the batch adds at most half the step's online sequences and tokens.
    while any(r.status == RequestStatus.RUNNING for r in online):
        out = step(sched)
        foreground = [s for s in out.scheduled if s.request.priority == 0]
        assert 0 < len(_background(out)) <= max(1, len(foreground) // 2)
        assert sum(len(s.token_ids) for s in _background(out)) <= max(
            1, sum(len(s.token_ids) for s in foreground) // 2
        )
    # Online work done: the batch takes the whole step again.
    assert len(_background(step(sched))) == 8


def test_background_prefill_is_chunked_to_its_token_share():
    alone = _background_scheduler(0.5, budget=8)
    alone.add_request(make_request(list(range(1, 21)), priority=10))
    assert step(alone).num_scheduled_tokens == 8  # alone: the whole budget
    shared = _background_scheduler(0.5, budget=16)
    shared.add_request(make_request(list(range(1, 9)), max_tokens=30))  # online, 8-token prompt
    shared.add_request(make_request(list(range(1, 21)), priority=10))
    out = step(shared)  # the online prompt (8 tokens) and half as many background ones
    assert [len(s.token_ids) for s in out.scheduled] == [8, 4]
    out = step(shared)  # the online decode (1 token): the batch still moves, by one token
    assert [len(s.token_ids) for s in out.scheduled] == [1, 1]


def test_an_online_request_takes_blocks_back_from_background_ones():
    bm = BlockManager(4, BLOCK, enable_prefix_caching=False)
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, background_priority=10, background_share=1.0
    )
    sched = Scheduler(config, bm)
    background = make_request(list(range(1, 4 * BLOCK - 1)), max_tokens=20, priority=10)
    sched.add_request(background)
    step(sched)  # alone, it holds every block
    online = make_request(list(range(1, BLOCK + 1)), max_tokens=4)
    sched.add_request(online)
    out = step(sched)
    assert out.preempted_req_ids == [background.request_id]
    assert [s.request for s in out.scheduled] == [online]
    while online.status == RequestStatus.RUNNING:
        step(sched)
    assert online.num_preemptions == 0 and online.output_token_ids


def test_background_requests_are_preempted_before_online_ones():
    bm = BlockManager(6, BLOCK, enable_prefix_caching=False)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, background_priority=10)
    sched = Scheduler(config, bm)
    background = make_request([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=20, priority=10)
    online = make_request([9, 10, 11, 12, 13, 14, 15, 16], max_tokens=20)
    sched.add_request(online)
    sched.add_request(background)
    for _ in range(8):  # both grow until the pool of 6 blocks cannot hold both
        step(sched)
    assert background.status == RequestStatus.PREEMPTED or background.num_preemptions > 0
    assert online.status == RequestStatus.RUNNING and online.num_preemptions == 0


def test_background_requests_run_by_priority_even_under_fcfs():
    sched = _background_scheduler(1.0, max_num_seqs=1)
    later = make_request([1, 2], max_tokens=2, priority=12)
    sooner = make_request([3, 4], max_tokens=2, priority=11)
    sched.add_request(later)
    sched.add_request(sooner)
    assert [s.request for s in step(sched).scheduled] == [sooner]


def test_background_work_stays_held_within_the_hold_window():
    bm = BlockManager(256, BLOCK, enable_prefix_caching=False)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        background_priority=10,
        background_share=0.5,
        background_hold_s=3600.0,
    )
    sched = Scheduler(config, bm)
    online = make_request([1, 2], max_tokens=1)
    sched.add_request(online)
    step(sched)  # the online request's only step: it finishes
    assert online.is_finished
    for _ in range(4):
        sched.add_request(make_request([3, 4, 5, 6], max_tokens=8, priority=10))
    out = step(sched)  # no online work now, but it was seen a moment ago: share of its step
    assert len(out.scheduled) == 1 and out.num_scheduled_tokens == 1
    sched.config = dataclasses.replace(config, background_hold_s=0.0)
    assert len(step(sched).scheduled) == 4  # without the window: the whole step
