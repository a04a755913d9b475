"""Speculative decoding against plain decoding, side by side in one run: batch-1 decode speed.

Two engines on the same weights, one with `--speculative-method`, decode the same prompts
greedily for `--max-tokens` tokens (EOS ignored, so both produce exactly as many), taking turns
(which goes first alternates per repeat, so drifting machine load favours neither). A request's
decode time runs from the end of its prefill step to its last token; its decode rate is
(tokens - 1) / that time. Figures are medians over `--repeat` runs; every run checks that both
engines produced the same tokens. Acceptance is the speculative engine's counters over the runs.

Workloads (the prompt text is `--text`, by default a passage in the checkpoint's own style):

- `copy`: the passage twice, then its first words again: the continuation copies (editing,
  extraction, where the output repeats spans of the prompt);
- `free`: the passage's first words only: the model writes on (what it repeats is its own).

    qiao bench spec --model qiao/demo_model --speculative-method ngram
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from qiao.bench.common import median, model_dir, write_json
from qiao.bench.shapes import shape_names
from qiao.settings_schema import (
    add_engine_flags,
    engine_group,
    exclusive_group,
    resolve_engine_flags,
)

DEFAULT_TEXT = (
    "KING HENRY. Now, lords, for France; the enterprise whereof shall be to you, as us, like "
    "glorious. We doubt not of a fair and lucky war, since God so graciously hath brought to "
    "light this dangerous treason lurking in our way."
)
SPEC_SETTINGS = (
    "speculative_method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
)


@dataclass
class SpecBenchConfig:
    model: str | None = None
    shape: str | None = None
    speculative_method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    text: str = DEFAULT_TEXT
    max_tokens: int = 128
    repeat: int = 5
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    # One intra-op thread by default: on a shared 2-core machine a busy second core stalls every
    # OpenMP region, which would time the neighbours rather than the engines.
    num_threads: int | None = 1


def workloads(cfg: SpecBenchConfig, tokenizer: Any, vocab_size: int) -> dict[str, list[int]]:
    """Prompt token ids per workload (a shape without a tokenizer: the text's bytes as ids)."""
    if tokenizer is not None:
        ids = list(tokenizer.encode(cfg.text))
    else:
        ids = [b % vocab_size for b in cfg.text.encode()]
    head = ids[: max(4, len(ids) // 6)]
    return {"copy": ids + ids + head, "free": head}


def _decode(
    engine: Any, prompt: list[int], max_tokens: int, rid: str
) -> tuple[list[int], float, float]:
    """(output tokens, seconds from the end of the prefill step to the last token, and the CPU
    seconds this process spent in them)."""
    from qiao.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(rid, prompt, params)
    outputs = engine.step()  # prefill and the first token
    begin, cpu_begin = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        outputs = engine.step()
    seconds, cpu_seconds = time.perf_counter() - begin, time.process_time() - cpu_begin
    (out,) = [o for o in outputs if o.request_id == rid]
    return out.outputs[0].token_ids, seconds, cpu_seconds


def run_spec_bench(cfg: SpecBenchConfig) -> dict[str, Any]:
    from qiao.entrypoints.llm import LLM

    spec_kwargs = {name: getattr(cfg, name) for name in SPEC_SETTINGS}
    with model_dir(cfg.model, cfg.shape) as path:
        common: dict[str, Any] = dict(
            max_num_seqs=1,
            dtype=cfg.dtype,
            device=cfg.device,
            seed=cfg.seed,
            num_threads=cfg.num_threads,
        )
        if cfg.shape is not None:
            common.update(load_format="dummy", skip_tokenizer_init=True)
        plain = LLM(str(path), **common)
        spec = LLM(str(path), **common, **spec_kwargs)
    prompts = workloads(cfg, plain.engine.tokenizer, plain.engine.arch.vocab_size)
    report: dict[str, Any] = {"config": dataclasses.asdict(cfg), "workloads": {}}
    for name, prompt in prompts.items():
        _decode(plain.engine, prompt, 8, f"warm-plain-{name}")
        _decode(spec.engine, prompt, 8, f"warm-spec-{name}")
        before = dict(spec.engine.speculator.stats.as_dict())
        times: dict[str, list[float]] = {"plain": [], "spec": []}
        cpu_times: dict[str, list[float]] = {"plain": [], "spec": []}
        for index in range(cfg.repeat):
            order = [("plain", plain), ("spec", spec)]
            if index % 2:
                order.reverse()
            tokens = {}
            for label, llm in order:
                tokens[label], seconds, cpu_seconds = _decode(
                    llm.engine, prompt, cfg.max_tokens, f"{label}-{name}-{index}"
                )
                times[label].append(seconds)
                cpu_times[label].append(cpu_seconds)
            if tokens["plain"] != tokens["spec"]:
                raise RuntimeError(f"{name}: speculative output differs from plain decoding")
        after = spec.engine.speculator.stats.as_dict()
        drafts = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = (
            after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        )
        steps = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        plain_s, spec_s = median(times["plain"]), median(times["spec"])
        plain_cpu, spec_cpu = median(cpu_times["plain"]), median(cpu_times["spec"])
        report["workloads"][name] = {
            "prompt_tokens": len(prompt),
            "decode_tokens": cfg.max_tokens - 1,
            "plain_decode_s": plain_s,
            "spec_decode_s": spec_s,
            "plain_tok_s": (cfg.max_tokens - 1) / plain_s,
            "spec_tok_s": (cfg.max_tokens - 1) / spec_s,
            "speedup": plain_s / spec_s,
            "plain_cpu_s": plain_cpu,
            "spec_cpu_s": spec_cpu,
            "cpu_speedup": plain_cpu / spec_cpu,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "tokens_per_verifying_step": 1 + accepted / steps if steps else 0.0,
            "identical_output": True,
            "runs_s": times,
            "runs_cpu_s": cpu_times,
        }
    report["device"] = str(spec.engine.runner.device)
    return report


def format_spec_bench(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"speculative decoding: {c['shape'] or c['model']}, {c['speculative_method']} "
        f"k={c['num_speculative_tokens']}, batch 1, {c['max_tokens']} tokens greedy, "
        f"median of {c['repeat']}, on {report['device']}",
        f"  {'workload':<8} {'plain tok/s':>12} {'spec tok/s':>12} {'speedup':>8} "
        f"{'CPU speedup':>12} {'accepted':>9} {'tok/step':>9}",
    ]
    for name, w in report["workloads"].items():
        lines.append(
            f"  {name:<8} {w['plain_tok_s']:>12.1f} {w['spec_tok_s']:>12.1f} "
            f"{w['speedup']:>7.2f}x {w['cpu_speedup']:>11.2f}x {w['acceptance_rate']:>9.1%} "
            f"{w['tokens_per_verifying_step']:>9.2f}"
        )
    lines += [
        "  (tok/s and speedup: wall clock; CPU speedup: this process's CPU seconds, which a",
        "  loaded machine does not inflate; accepted: draft tokens kept / proposed; tok/step:",
        "  tokens per verifying step)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qiao bench spec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = engine_group(parser, "model under test")
    source = exclusive_group(group, required=True)
    add_engine_flags(source, ["model"], config_flag=False, from_env=False)
    source.add_argument(
        "--shape", choices=shape_names(), help="a built-in model shape with dummy weights"
    )
    add_engine_flags(
        group,
        (*SPEC_SETTINGS, "dtype", "device", "seed", "num_threads"),
        defaults={"speculative_method": "ngram", "num_threads": 1},
        config_flag=False,
    )
    parser.add_argument("--text", default=DEFAULT_TEXT, help="the passage the prompts are made of")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--repeat", type=int, default=5, help="runs; figures are medians")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    args = parser.parse_args(argv)
    resolve_engine_flags(args)
    fields = {f.name for f in dataclasses.fields(SpecBenchConfig)}
    cfg = SpecBenchConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    report = run_spec_bench(cfg)
    print(format_spec_bench(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
