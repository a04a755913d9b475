"""`qiao tune`: measure this machine with this model once, and write the profile `LLM(...)` and
`qiao serve` take their defaults from (`qiao/profile.py`).

Every figure comes from real engine steps (`LLMEngine.step()` on random token-id prompts):

- `num_threads`: decode tokens/s at a small batch for each thread count; the fastest wins.
- `max_num_seqs`: decode tokens/s with B sequences running, for each B; the smallest B within
  5 % of the best wins (more running sequences cost each one latency).
- `max_num_batched_tokens`: prefill tokens/s of prompts chunked under each token budget; the
  smallest budget within 5 % of the best wins (a smaller step leaves decode streams less to
  wait for), but never below `max_num_seqs`, so that every running sequence decodes each step.
- `num_kv_blocks`: the KV memory budget (the engine's default sizing, or `--max-memory`) over
  the bytes of one block; `max_num_seqs` is lowered when that pool cannot hold so many
  sequences of a useful length (`USEFUL_LEN` tokens), since the rest would only be preempted.
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qiao.bench.common import EngineArgs, build_llm, model_dir
from qiao.bench.tune_sweeps import (
    FULL_PLAN,
    QUICK_PLAN,
    TunePlan,
    budget_for_itl,
    sweep_batch_sizes,
    sweep_threads,
    sweep_token_budgets,
)
from qiao.profile import (
    SCHEMA_VERSION,
    TUNED_SETTINGS,
    MachineFacts,
    ModelIdentity,
    Profile,
    TunedSettings,
    profile_path,
    write_profile,
)
from qiao.version import __version__

if TYPE_CHECKING:
    from tqdm import tqdm

    from qiao.entrypoints.llm import LLM
    from qiao.models.arch_config import ArchConfig

USEFUL_LEN = 1024  # tokens a sequence should have room for when the KV pool bounds the batch


@dataclass
class TuneConfig:
    model: str | None
    shape: str | None
    dtype: str = "auto"
    quantization: str | None = None
    load_format: str = "auto"
    quick: bool = False
    max_memory: float | None = None  # KV budget: bytes (> 1) or a share of memory (<= 1)
    threads: tuple[int, ...] | None = None  # candidates; None: the plan's
    batch_sizes: tuple[int, ...] | None = None
    token_budgets: tuple[int, ...] | None = None
    block_size: int = 16
    # Serve under this p99 inter-token latency (seconds): the token budget then comes from the
    # measured step times (`budget_for_itl`), not from the prefill sweep.
    itl_slo: float | None = None
    out: str | None = None  # None: the profile's place under QIAO_PROFILE_DIR
    seed: int = 0
    show_progress: bool = True

    def plan(self, machine: MachineFacts) -> TunePlan:
        plan = QUICK_PLAN if self.quick else FULL_PLAN
        return replace(
            plan,
            thread_counts=tuple(sorted(set(self.threads or default_thread_counts(machine)))),
            batch_sizes=tuple(sorted(set(self.batch_sizes or plan.batch_sizes))),
            token_budgets=tuple(sorted(set(self.token_budgets or plan.token_budgets))),
        )


def default_thread_counts(machine: MachineFacts) -> tuple[int, ...]:
    """1, 2, 4, ... up to the physical cores, and the physical cores themselves."""
    cores = machine.num_physical_cores
    return (*(2**i for i in range(cores.bit_length()) if 2**i < cores), cores)


def run_tune(cfg: TuneConfig) -> tuple[Profile, Path]:
    """Measure, choose, write the profile; return it and where it was written."""
    import torch

    machine = MachineFacts.current()
    plan = cfg.plan(machine)
    original_threads = torch.get_num_threads()
    started, load_before = time.perf_counter(), _load_average()
    try:
        with model_dir(cfg.model, cfg.shape) as path, _progress(plan, cfg) as bar:
            identity, measurements = _measure(cfg, plan, path, bar)
    finally:
        torch.set_num_threads(original_threads)
    measurements["seconds"] = round(time.perf_counter() - started, 2)
    # Other work on the CPUs skews every figure; the report warns when there was some.
    measurements["load_average_before"] = load_before
    profile = Profile(
        schema_version=SCHEMA_VERSION,
        qiao_version=__version__,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        quick=cfg.quick,
        machine=machine,
        model=identity,
        block_size=cfg.block_size,
        settings=TunedSettings(**{name: measurements[name]["chosen"] for name in TUNED_SETTINGS}),
        measurements=measurements,
    )
    out = Path(cfg.out).expanduser() if cfg.out else profile_path(identity, machine)
    return profile, write_profile(profile, out)


def _measure(
    cfg: TuneConfig, plan: TunePlan, path: Path, bar: tqdm
) -> tuple[ModelIdentity, dict[str, Any]]:
    """Every sweep, in order: threads, then batch sizes and KV at the chosen thread count, then
    token budgets (an engine each, since the budget is fixed at engine start)."""
    import torch

    from qiao.models.arch_config import load_arch_config

    arch = load_arch_config(path)
    llm = build_llm(path, _decode_engine_args(cfg, plan))
    identity = _identity(cfg, llm)
    threads = sweep_threads(llm.engine, plan, arch.vocab_size, bar)
    torch.set_num_threads(threads["chosen"])
    seqs = sweep_batch_sizes(llm.engine, plan, arch.vocab_size, bar)
    budgets = None
    if cfg.itl_slo is not None:
        budgets = budget_for_itl(seqs, cfg.itl_slo, seqs["chosen"])
        seqs["rule"] += "; at most the ITL-derived token budget"
    kv = _size_kv(llm, arch, cfg, budgets["max_num_seqs"] if budgets else seqs["chosen"])
    seqs["fastest_smallest"], seqs["chosen"] = seqs["chosen"], kv.pop("max_num_seqs")
    ceilings = _ceilings(llm, plan.quick)
    bar.update(1)
    del llm
    gc.collect()
    if budgets is None:
        budgets = sweep_token_budgets(
            path, _decode_engine_args(cfg, plan), plan, arch.vocab_size, seqs["chosen"], bar
        )
    measurements = {
        "num_threads": threads,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": budgets,
        "num_kv_blocks": kv,
        "cpu_ceilings": ceilings,
    }
    return identity, measurements


def _decode_engine_args(cfg: TuneConfig, plan: TunePlan) -> EngineArgs:
    """One engine for the decode sweeps: room for the largest batch, every prompt prefilled in
    one step, and each sequence's prompt plus the most decode steps timed."""
    max_batch = max(plan.batch_sizes + (plan.thread_batch_size,))
    return EngineArgs(
        load_format="dummy" if cfg.shape is not None else cfg.load_format,
        dtype=cfg.dtype,
        quantization=cfg.quantization,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(max_batch * plan.decode_prompt_len, 2048),
        max_model_len=plan.decode_prompt_len + plan.decode_max_steps + 3,
        seed=cfg.seed,
    )


def _identity(cfg: TuneConfig, llm: LLM) -> ModelIdentity:
    dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
    if cfg.shape is not None:
        return ModelIdentity(shape=cfg.shape, dtype=dtype, quantization=cfg.quantization)
    assert cfg.model is not None
    return ModelIdentity.for_checkpoint(cfg.model, dtype, cfg.quantization)


# --- KV pool ----------------------------------------------------------------------------------


def _size_kv(llm: LLM, arch: ArchConfig, cfg: TuneConfig, max_num_seqs: int) -> dict[str, Any]:
    """The pool the engine would size for `max_num_seqs` full-context sequences, from the
    default budget or `--max-memory`; and how many sequences of USEFUL_LEN tokens it holds."""
    from qiao.config import CacheConfig

    runner = llm.engine.runner
    block_size = cfg.block_size
    per_block = runner.kv_bytes_per_block(block_size)
    full_context_blocks = math.ceil(arch.max_position_embeddings / block_size)
    cache = CacheConfig(block_size=block_size, kv_cache_memory=cfg.max_memory)
    num_blocks = runner.determine_num_blocks(cache, max_num_seqs * full_context_blocks)
    useful_len = min(USEFUL_LEN, arch.max_position_embeddings)
    seqs_that_fit = max(1, num_blocks // math.ceil(useful_len / block_size))
    return {
        "rule": "the KV budget over bytes per block, at most max_num_seqs full contexts; "
        f"max_num_seqs lowered to the sequences of {useful_len} tokens that fit",
        "budget": "--max-memory" if cfg.max_memory is not None else "engine default",
        "max_memory": cfg.max_memory,
        "block_size": block_size,
        "kv_bytes_per_block": per_block,
        "kv_bytes": num_blocks * per_block,
        "max_position_embeddings": arch.max_position_embeddings,
        "useful_len": useful_len,
        "seqs_of_useful_len": seqs_that_fit,
        "max_num_seqs_lowered": seqs_that_fit < max_num_seqs,
        "max_num_seqs": min(max_num_seqs, seqs_that_fit),
        "chosen": num_blocks,
    }


# --- ceilings, progress ---------------------------------------------------------------


def _load_average() -> float | None:
    """Runnable processes over the last minute, before this one starts measuring."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


def _ceilings(llm: LLM, quick: bool) -> dict[str, Any] | None:
    """The CPU's copy bandwidth and matmul rate at the chosen threads (`qiao bench hw`), for
    reading the figures against; None when the engine runs on an accelerator."""
    from qiao.bench.hw import COPY_MIB, QUICK_COPY_MIB, measure_ceiling_gflops, measure_copy_gbps

    if llm.engine.runner.device.type != "cpu":
        return None
    dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
    return {
        "copy_gbps": measure_copy_gbps(QUICK_COPY_MIB if quick else COPY_MIB),
        "matmul_gflops": measure_ceiling_gflops(dtype, quick),
        "matmul_dtype": dtype,
    }


def _progress(plan: TunePlan, cfg: TuneConfig) -> Any:
    """A tqdm bar over every measurement point (one per candidate, plus the ceilings)."""
    from tqdm.auto import tqdm

    num_budget_runs = 0 if cfg.itl_slo else len(plan.token_budgets) * plan.prefill_passes
    total = len(plan.thread_counts) + len(plan.batch_sizes) + num_budget_runs + 1
    return tqdm(
        total=total, desc="qiao tune", unit="point", leave=False, disable=not cfg.show_progress
    )
