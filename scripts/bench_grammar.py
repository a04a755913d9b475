"""Compare the grammar engines for structured output: llguidance and xgrammar, side by side.

    .venv/bin/python scripts/bench_grammar.py [--json docs/results/grammar_engines.json]

Needs both packages (`pip install llguidance xgrammar`; xgrammar's GPU kernels need triton,
which this CPU comparison does not import). The tokenizer is a byte-level BPE of 49,152 tokens
(SmolLM2's vocabulary size) trained here on the standard library's sources and cached: no model
hub is needed, and grammar engines see a real BPE vocabulary. For each engine and each schema:

- compile time: a fresh compiler each time (no cache), median of `--repeat`;
- mask time at batch 1: fill one token mask, then accept the next token of a valid instance,
  for every token of it; mean per token;
- mask time at batch 64: 64 matchers (the schemas in turn) each at its own position, all masks
  of a step filled (llguidance's parallel executor; xgrammar's batch matcher), then each
  accepts its token; mean per step;
- applying the 64 masks to float32 logits, each engine's own function and qiao's.

`--overhead` also runs qiao's engine on the smollm2-135m shape (random weights, this tokenizer)
with 64 sequences decoding 64 tokens each, free and constrained to a JSON schema in turn, and
reports the time spent filling and applying masks as a share of step time, and the wall-time
ratio of the two runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 49152
BATCH = 64

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat object": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "email": {"type": "string"},
            },
            "required": ["name", "age", "email"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    ),
    "nested with arrays and enums": (
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string"},
                "status": {"enum": ["pending", "shipped", "delivered"]},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer"},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "quantity", "price"],
                    },
                },
                "notes": {"type": ["string", "null"]},
            },
            "required": ["order_id", "status", "items", "notes"],
        },
        {
            "order_id": "A-1024",
            "status": "shipped",
            "items": [
                {"sku": "pen-blue", "quantity": 12, "price": 1.25},
                {"sku": "notebook", "quantity": 3, "price": 4.5},
            ],
            "notes": None,
        },
    ),
    "tool call": (
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    },
                    "required": ["city", "unit"],
                },
            },
            "required": ["name", "arguments"],
        },
        {"name": "get_weather", "arguments": {"city": "Hangzhou", "unit": "celsius", "days": 3}},
    ),
    "string patterns": (
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            },
            "required": ["date", "code", "tags"],
        },
        {"date": "2026-12-04", "code": "QIA042", "tags": ["alpha", "beta"]},
    ),
    "any JSON (json_object)": (
        {"type": "object"},
        {"summary": "a free-form object", "scores": [0.5, 0.25], "ok": True, "extra": {"a": 1}},
    ),
}


def build_tokenizer() -> Any:
    """A byte-level BPE (cached) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    cache = Path.home() / ".cache" / "qiao" / f"bench-bpe-{VOCAB_SIZE}.json"
    if not cache.is_file():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(str(p) for p in stdlib.glob("*.py"))
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train(files, trainer)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(cache))
    return PreTrainedTokenizerFast(tokenizer_file=str(cache), eos_token="<|endoftext|>")


def instance_tokens(tokenizer: Any, instance: Any) -> list[int]:
    text = json.dumps(instance, separators=(",", ":"))  # compact, as the grammars are
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 4)


# --- llguidance -----------------------------------------------------------------------------


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llg_torch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def allocate(self, batch: int, vocab: int) -> torch.Tensor:
        return self.llg_torch.allocate_token_bitmask(batch, vocab)

    def fill(self, matcher: Any, bitmask: torch.Tensor, index: int) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, index)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llg_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llg_torch.apply_token_bitmask_inplace(logits, bitmask)


# --- xgrammar -------------------------------------------------------------------------------


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))

    def compile(self, schema: dict[str, Any]) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, batch: int, vocab: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, vocab)

    def fill(self, matcher: Any, bitmask: torch.Tensor, index: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, index)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if not hasattr(self, "batch"):
            self.batch = self.xgr.BatchGrammarMatcher()
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


def qiao_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    from qiao.runner.grammar import apply_token_bitmask

    apply_token_bitmask(logits, bitmask)


# --- measurement ----------------------------------------------------------------------------


def measure(engine: Any, tokenizer: Any, repeat: int) -> dict[str, Any]:
    vocab = len(tokenizer)
    result: dict[str, Any] = {"schemas": {}}
    compiled = {}
    for label, (schema, instance) in SCHEMAS.items():
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            compiled[label] = engine.compile(schema)
            times.append(time.perf_counter() - start)
        tokens = instance_tokens(tokenizer, instance)
        bitmask = engine.allocate(1, vocab)
        per_token = []
        for _ in range(repeat):
            matcher = engine.matcher(compiled[label])
            start = time.perf_counter()
            for token in tokens:
                engine.fill(matcher, bitmask, 0)
                engine.accept(matcher, token)
            per_token.append((time.perf_counter() - start) / len(tokens))
        result["schemas"][label] = {
            "compile_ms": median_ms(times),
            "tokens": len(tokens),
            "mask_and_accept_ms_per_token_batch_1": median_ms(per_token),
        }
    # Batch 64: each row a schema in turn, starting at a different offset of its instance.
    labels = list(SCHEMAS)
    rows = []
    for i in range(BATCH):
        label = labels[i % len(labels)]
        rows.append((compiled[label], instance_tokens(tokenizer, SCHEMAS[label][1])))
    steps = min(len(tokens) for _, tokens in rows)
    bitmask = engine.allocate(BATCH, vocab)
    per_step = []
    for _ in range(repeat):
        matchers = [engine.matcher(c) for c, _ in rows]
        start = time.perf_counter()
        for step in range(steps):
            engine.fill_batch(matchers, bitmask)
            for matcher, (_, tokens) in zip(matchers, rows, strict=True):
                engine.accept(matcher, tokens[step])
        per_step.append((time.perf_counter() - start) / steps)
    result["mask_and_accept_ms_per_step_batch_64"] = median_ms(per_step)
    logits = torch.randn(BATCH, vocab)
    for name, apply in (("engine", engine.apply), ("qiao", qiao_apply)):
        times = []
        for _ in range(max(repeat, 5)):
            target = logits.clone()
            start = time.perf_counter()
            apply(target, bitmask)
            times.append(time.perf_counter() - start)
        result[f"apply_ms_batch_64_{name}"] = median_ms(times)
    result["compile_ms_median"] = round(
        statistics.median(s["compile_ms"] for s in result["schemas"].values()), 3
    )
    result["mask_ms_per_token_batch_1_median"] = round(
        statistics.median(
            s["mask_and_accept_ms_per_token_batch_1"] for s in result["schemas"].values()
        ),
        4,
    )
    return result


def step_overhead(tokenizer: Any, repeat: int) -> dict[str, Any]:
    """Constrained vs free decoding of 64 sequences in qiao's engine, on the 135M shape."""
    from qiao import LLM, SamplingParams
    from qiao.bench.shapes import write_shape_dir
    from qiao.runner.model_runner import ModelRunner

    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    with tempfile.TemporaryDirectory() as directory:
        write_shape_dir("smollm2-135m", directory)
        tokenizer.save_pretrained(directory)
        llm = LLM(directory, load_format="dummy", max_num_seqs=BATCH, seed=0)
        mask_time = [0.0]
        apply_grammars = ModelRunner._apply_grammars

        def timed(self: Any, *args: Any) -> None:
            start = time.perf_counter()
            apply_grammars(self, *args)
            mask_time[0] += time.perf_counter() - start

        ModelRunner._apply_grammars = timed  # type: ignore[method-assign]
        prompts = [f"Write item {i} of the list as JSON with a text field." for i in range(BATCH)]
        runs: dict[str, list[float]] = {"free": [], "constrained": []}
        shares = []
        for _ in range(repeat):
            for label in ("free", "constrained"):
                params = SamplingParams(
                    temperature=1.0,
                    seed=1,
                    max_tokens=64,
                    ignore_eos=True,
                    structured_outputs={"json": schema} if label == "constrained" else None,
                )
                mask_time[0] = 0.0
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                runs[label].append(elapsed)
                if label == "constrained":
                    shares.append(mask_time[0] / elapsed)
        ModelRunner._apply_grammars = apply_grammars  # type: ignore[method-assign]
    free, constrained = statistics.median(runs["free"]), statistics.median(runs["constrained"])
    return {
        "shape": "smollm2-135m",
        "dtype": str(llm.engine.runner.dtype),
        "sequences": BATCH,
        "output_tokens": 64,
        "free_s": round(free, 3),
        "constrained_s": round(constrained, 3),
        "wall_ratio": round(constrained / free, 4),
        "mask_share_of_run": round(statistics.median(shares), 4),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--overhead", action="store_true", help="also measure qiao's constrained decoding"
    )
    args = parser.parse_args(argv)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    report: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "batch": BATCH,
        "repeat": args.repeat,
        "torch_threads": 1,
    }
    for engine_class in (LLGuidance, XGrammar):
        engine = engine_class(tokenizer)
        report[engine.name] = measure(engine, tokenizer, args.repeat)
    for name in ("llguidance", "xgrammar"):
        r = report[name]
        print(
            f"{name:<11} compile {r['compile_ms_median']:8.2f} ms (median)   "
            f"mask+accept b=1 {r['mask_ms_per_token_batch_1_median']:.4f} ms/token   "
            f"b=64 {r['mask_and_accept_ms_per_step_batch_64']:.3f} ms/step   "
            f"apply b=64: own {r['apply_ms_batch_64_engine']:.3f} ms, "
            f"qiao {r['apply_ms_batch_64_qiao']:.3f} ms"
        )
        for label, s in r["schemas"].items():
            print(
                f"    {label:<30} compile {s['compile_ms']:8.2f} ms  "
                f"b=1 {s['mask_and_accept_ms_per_token_batch_1']:.4f} ms/token"
            )
    if args.overhead:
        torch.set_num_threads(default_threads)
        report["overhead"] = overhead = step_overhead(tokenizer, args.repeat)
        print(
            f"qiao, {overhead['sequences']} sequences x {overhead['output_tokens']} tokens on "
            f"{overhead['shape']} ({overhead['dtype']}): free {overhead['free_s']} s, "
            f"constrained {overhead['constrained_s']} s (x{overhead['wall_ratio']}); "
            f"masks {overhead['mask_share_of_run'] * 100:.1f} % of the constrained run"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
