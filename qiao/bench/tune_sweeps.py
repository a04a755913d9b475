"""The measurements behind `qiao tune`, each on real engine steps over random token-id prompts:
decode tokens/s per thread count and per number of running sequences (one engine, driven step by
step), prefill tokens/s per token budget (an engine per budget, fixed at engine start)."""

from __future__ import annotations

import gc
import itertools
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qiao.bench.common import EngineArgs, LengthSpec, build_llm, make_workload, median

if TYPE_CHECKING:
    from tqdm import tqdm

    from qiao.engine.llm_engine import LLMEngine
    from qiao.entrypoints.llm import LLM

TOLERANCE = 0.05  # "as fast as the best": within this share of it
# Under an inter-token latency SLO, a full step may take this share of it. The rest is headroom
# for attention over long contexts, output streaming and the host's noise: serving the 135M
# shape on the 2-core development machine (300 Poisson requests of 128 + 128 tokens), p99 ITL
# came to 0.92x this estimate at budget 80 and 1.06-1.11x at 96.
ITL_STEP_SHARE = 0.8
BUDGET_GRANULE = 16  # ITL-derived token budgets are multiples of this


@dataclass(frozen=True)
class TunePlan:
    """What to measure, and for how long."""

    thread_counts: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    token_budgets: tuple[int, ...]
    thread_batch_size: int  # decode batch of the thread sweep
    decode_prompt_len: int
    decode_min_steps: int
    decode_max_steps: int
    decode_min_time: float  # seconds of decode steps timed per point, within the step bounds
    prefill_num_prompts: int  # prompts of max(token_budgets) / this many tokens each
    prefill_passes: int  # timed prefill runs per budget, interleaved; the fastest counts
    quick: bool = False


FULL_PLAN = TunePlan(
    thread_counts=(),  # filled in from the machine: powers of two up to the physical cores
    batch_sizes=(1, 8, 16, 32, 64, 128, 256),
    token_budgets=(256, 512, 1024, 2048),
    thread_batch_size=8,
    decode_prompt_len=32,
    decode_min_steps=3,
    decode_max_steps=32,
    decode_min_time=0.5,
    prefill_num_prompts=2,
    prefill_passes=2,
)
QUICK_PLAN = TunePlan(
    thread_counts=(),
    batch_sizes=(1, 4, 8),
    token_budgets=(16, 32, 64),
    thread_batch_size=4,
    decode_prompt_len=8,
    decode_min_steps=2,
    decode_max_steps=4,
    decode_min_time=0.0,
    prefill_num_prompts=2,
    prefill_passes=1,
    quick=True,
)


# --- decode ----------------------------------------------------------------------------


class _DecodeTimer:
    """Runs B sequences through the engine and times whole decode steps (B tokens each)."""

    def __init__(self, engine: LLMEngine, plan: TunePlan, vocab_size: int, seed: int = 0) -> None:
        self.engine = engine
        self.plan = plan
        self.vocab_size = vocab_size
        self.seed = seed
        self._ids = itertools.count()

    def tok_s(self, batch_size: int) -> dict[str, float]:
        """Decode tokens/s with `batch_size` sequences running, from the median step."""
        from qiao.sampling_params import SamplingParams

        plan = self.plan
        length = LengthSpec(plan.decode_prompt_len, plan.decode_prompt_len)
        prompts = make_workload(batch_size, length, length, self.vocab_size, self.seed).prompts
        params = SamplingParams(
            temperature=0.0, max_tokens=plan.decode_max_steps + 2, ignore_eos=True
        )
        request_ids = [f"tune-{next(self._ids)}" for _ in prompts]
        for request_id, prompt in zip(request_ids, prompts, strict=True):
            self.engine.add_request(request_id, prompt, params)
        try:
            self._prefill(batch_size)
            self.engine.step()  # untimed: the first step at a new batch size allocates
            steps = self._timed_steps(batch_size)
        finally:
            self.engine.abort_request(request_ids)
        step_s = median(steps)
        return {"decode_tok_s": batch_size / step_s, "step_ms": step_s * 1e3, "steps": len(steps)}

    def _prefill(self, batch_size: int) -> None:
        # Each sequence yields its first token when its prompt is done.
        target = self.engine.num_generated_tokens_total + batch_size
        while self.engine.num_generated_tokens_total < target:
            self.engine.step()

    def _timed_steps(self, batch_size: int) -> list[float]:
        plan, steps = self.plan, []
        while len(steps) < plan.decode_max_steps and (
            len(steps) < plan.decode_min_steps or sum(steps) < plan.decode_min_time
        ):
            before = self.engine.num_generated_tokens_total
            begin = time.perf_counter()
            self.engine.step()
            steps.append(time.perf_counter() - begin)
            produced = self.engine.num_generated_tokens_total - before
            if produced != batch_size:
                raise RuntimeError(
                    f"a decode step made {produced} tokens for {batch_size} sequences"
                )
        return steps


def sweep_threads(engine: LLMEngine, plan: TunePlan, vocab_size: int, bar: tqdm) -> dict[str, Any]:
    import torch

    timer = _DecodeTimer(engine, plan, vocab_size)
    timer.tok_s(plan.thread_batch_size)  # warm-up: first-step allocations stay out of timing
    results = []
    for num_threads in plan.thread_counts:
        bar.set_description(f"threads={num_threads}")
        torch.set_num_threads(num_threads)
        results.append({"num_threads": num_threads, **timer.tok_s(plan.thread_batch_size)})
        bar.update(1)
    best = max(results, key=lambda r: r["decode_tok_s"])
    return {
        "metric": f"decode tokens/s at batch {plan.thread_batch_size}",
        "rule": "the fastest",
        "candidates": results,
        "chosen": best["num_threads"],
    }


def sweep_batch_sizes(
    engine: LLMEngine, plan: TunePlan, vocab_size: int, bar: tqdm
) -> dict[str, Any]:
    timer = _DecodeTimer(engine, plan, vocab_size)
    results = []
    for batch_size in plan.batch_sizes:
        bar.set_description(f"max_num_seqs={batch_size}")
        results.append({"batch_size": batch_size, **timer.tok_s(batch_size)})
        bar.update(1)
    chosen = smallest_near_best(results, "batch_size", "decode_tok_s")
    return {
        "metric": "decode tokens/s with that many sequences running",
        "rule": f"the smallest batch within {TOLERANCE:.0%} of the best",
        "candidates": results,
        "chosen": chosen,
    }


def budget_for_itl(
    batch_sweep: dict[str, Any], itl_slo: float, max_num_seqs: int
) -> dict[str, Any]:
    """The token budget for serving under a p99 inter-token latency of `itl_slo` seconds: the
    largest multiple of BUDGET_GRANULE whose full step, estimated from the measured decode steps
    (each token a decode token, the costliest kind: it needs its logits), takes at most
    ITL_STEP_SHARE of the SLO. Step time is linear in the step's tokens between the measured
    batch sizes (interpolated there, extrapolated past the largest from the last two). At
    least BUDGET_GRANULE even when that step is already too slow (`feasible` says so).

    The budget caps max_num_seqs too: every running sequence then gets its token each step,
    which is what bounds the inter-token latency.
    """
    points = sorted((r["batch_size"], r["step_ms"] / 1e3) for r in batch_sweep["candidates"])
    target = ITL_STEP_SHARE * itl_slo

    def step_s(tokens: int) -> float:
        if len(points) == 1:
            return points[0][1] * tokens / points[0][0]
        pairs = list(itertools.pairwise(points))
        (b0, t0), (b1, t1) = next(((p, q) for p, q in pairs if tokens <= q[0]), pairs[-1])
        return t0 + (t1 - t0) * (tokens - b0) / (b1 - b0)

    budget = BUDGET_GRANULE
    while step_s(budget + BUDGET_GRANULE) <= target and budget < 64 * 1024:
        budget += BUDGET_GRANULE
    return {
        "metric": f"full-step time, ms, from the decode steps by running sequences "
        f"(SLO: p99 inter-token latency {itl_slo * 1e3:.0f} ms)",
        "rule": f"the largest multiple of {BUDGET_GRANULE} whose full step takes at most "
        f"{ITL_STEP_SHARE:.0%} of the ITL SLO; max_num_seqs at most the budget",
        "candidates": [
            {"max_num_batched_tokens": b, "step_ms": round(step_s(b) * 1e3, 2)}
            for b in range(BUDGET_GRANULE, budget + 2 * BUDGET_GRANULE, BUDGET_GRANULE)
        ],
        "itl_slo_s": itl_slo,
        "feasible": step_s(budget) <= target,
        "max_num_seqs": min(max_num_seqs, budget),
        "chosen": budget,
    }


def smallest_near_best(results: list[dict[str, Any]], key: str, metric: str) -> int:
    """The smallest `key` whose `metric` is within TOLERANCE of the best `metric`."""
    best = max(r[metric] for r in results)
    return min(r[key] for r in results if r[metric] >= (1 - TOLERANCE) * best)


# --- prefill ----------------------------------------------------------------------------


def sweep_token_budgets(
    path: Path, base_args: EngineArgs, plan: TunePlan, vocab_size: int, max_num_seqs: int, bar: tqdm
) -> dict[str, Any]:
    """Prefill tokens/s per budget: an engine each (the budget is fixed at engine start), in
    `prefill_passes` interleaved passes over the budgets; each budget's best pass counts, so
    a burst of load from elsewhere does not decide."""
    prompt_len = max(1, max(plan.token_budgets) // plan.prefill_num_prompts)
    seconds: dict[int, list[float]] = {budget: [] for budget in plan.token_budgets}
    for index in range(plan.prefill_passes):
        for budget in plan.token_budgets:
            bar.set_description(f"max_num_batched_tokens={budget}")
            seconds[budget].append(
                _prefill_run(path, base_args, plan, budget, prompt_len, vocab_size, seed=index)
            )
            bar.update(1)
    num_tokens = plan.prefill_num_prompts * prompt_len
    results = [
        {"max_num_batched_tokens": budget, "prefill_tok_s": num_tokens / min(runs), "runs": runs}
        for budget, runs in seconds.items()
    ]
    return _choose_budget(results, plan, prompt_len, max_num_seqs)


def _prefill_run(
    path: Path,
    base_args: EngineArgs,
    plan: TunePlan,
    budget: int,
    prompt_len: int,
    vocab_size: int,
    seed: int,
) -> float:
    """Seconds to prefill `prefill_num_prompts` prompts of `prompt_len` under `budget`, on a
    fresh engine warmed up by one short prompt."""
    args = replace(
        base_args,
        max_num_seqs=plan.prefill_num_prompts,
        max_num_batched_tokens=budget,
        max_model_len=prompt_len + 1,
    )
    llm = build_llm(path, args)
    try:
        warm_up = make_workload(1, LengthSpec(8, 8), LengthSpec(1, 1), vocab_size, -1)
        _prefill_seconds(llm, warm_up.prompts)
        length = LengthSpec(prompt_len, prompt_len)
        prompts = make_workload(plan.prefill_num_prompts, length, length, vocab_size, seed)
        return _prefill_seconds(llm, prompts.prompts)
    finally:
        del llm
        gc.collect()


def _choose_budget(
    results: list[dict[str, Any]], plan: TunePlan, prompt_len: int, max_num_seqs: int
) -> dict[str, Any]:
    eligible = [r for r in results if r["max_num_batched_tokens"] >= max_num_seqs]
    if eligible:
        chosen = smallest_near_best(eligible, "max_num_batched_tokens", "prefill_tok_s")
    else:  # every budget measured is below one decode token per running sequence
        chosen = max_num_seqs
    return {
        "metric": f"prefill tokens/s of {plan.prefill_num_prompts} prompts of {prompt_len} tokens",
        "rule": f"the smallest budget within {TOLERANCE:.0%} of the best, "
        f"at least max_num_seqs ({max_num_seqs})",
        "candidates": results,
        "chosen": chosen,
    }


def _prefill_seconds(llm: LLM, prompts: list[list[int]]) -> float:
    from qiao.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    begin = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - begin
