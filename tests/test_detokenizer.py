from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qiao.engine.detokenizer import IncrementalDetokenizer
from qiao.sampling_params import SamplingParams

MODEL_DIR = Path("/work/shared/models/stories260K-hf")
PROMPT = [1, 403, 407, 261, 378]  # <s> Once upon a time
STORY = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]
STORY += [410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394]
STORY_TEXT = (
    ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
)
BOS, EOS = 1, 2
# stories260K: ids 0-2 are <unk> <s> </s>, 3-258 the byte-fallback tokens <0x00>..<0xFF>.
BYTE_OFFSET = 3
NORMAL_IDS = range(259, 512)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if not MODEL_DIR.is_dir():
        pytest.skip(f"tokenizer folder {MODEL_DIR} is absent")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


def stream(
    tokenizer: Any, prompt: list[int], ids: list[int], **params: Any
) -> tuple[IncrementalDetokenizer, str | None, list[str]]:
    """Feed `ids` one at a time as the engine does; returns (detokenizer, stop, stream deltas)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(**params))
    deltas: list[str] = []
    stop = None
    for i, token_id in enumerate(ids):
        stop = detok.update([token_id])
        deltas.append(detok.get_delta_text(finished=stop is not None or i == len(ids) - 1))
        if stop is not None:
            break
    return detok, stop, deltas


def test_reference_story_one_token_at_a_time(tokenizer: Any) -> None:
    detok, stop, deltas = stream(tokenizer, PROMPT, STORY)
    assert stop is None
    assert detok.output_text == STORY_TEXT
    assert "".join(deltas) == STORY_TEXT
    assert deltas[:3] == [",", " there", " was"]


def test_first_token_keeps_its_leading_space(tokenizer: Any) -> None:
    assert stream(tokenizer, PROMPT, [432])[0].output_text == ","
    assert stream(tokenizer, PROMPT, [383])[0].output_text == " there"
    # With no left context the text matches a plain decode, which drops the first space.
    assert stream(tokenizer, [BOS], [383])[0].output_text == tokenizer.decode([383]) == "there"


def test_multi_token_update_equals_one_at_a_time(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams())
    assert detok.update(STORY[:7]) is None
    assert detok.update(STORY[7:]) is None
    assert detok.output_text == STORY_TEXT


def test_cjk_byte_fallback_never_streams_broken_characters(tokenizer: Any) -> None:
    byte_ids = [b + BYTE_OFFSET for b in "你好".encode()]
    assert tokenizer.convert_ids_to_tokens(byte_ids[:1]) == ["<0xE4>"]
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams())
    deltas = []
    for token_id in [432, 410, *byte_ids]:  # ", " then the six bytes of 你好
        detok.update([token_id])
        assert "\ufffd" not in detok.output_text
        deltas.append(detok.get_delta_text(finished=False))
    assert deltas == [",", " ", "", "", "你", "", "", "好"]
    assert detok.output_text == ", 你好"


def test_invalid_bytes_are_released_after_a_bounded_wait(tokenizer: Any) -> None:
    invalid = 0xFF + BYTE_OFFSET
    detok, _, deltas = stream(tokenizer, PROMPT, [invalid] * 10 + [383])
    # At most 3 tokens pend; the rest already came out as U+FFFD.
    assert deltas[3] == "\ufffd"
    assert detok.output_text == "\ufffd" * 10 + " there"


def test_cjk_prompt_context_does_not_break_cjk_output(tokenizer: Any) -> None:
    # The last 4 prompt tokens <0xA0> <0xE5> <0xA5> <0xBD> start mid-character.
    prompt = [BOS, *(b + BYTE_OFFSET for b in "你好".encode())]
    ids = [b + BYTE_OFFSET for b in "你好".encode()]
    detok, _, deltas = stream(tokenizer, prompt, ids)
    assert detok.output_text == "你好"
    assert "\ufffd" not in "".join(deltas)


def test_skip_special_tokens(tokenizer: Any) -> None:
    ids = [432, 383, EOS, 286, BOS, 261]
    skipped = stream(tokenizer, PROMPT, ids)[0].output_text
    kept = stream(tokenizer, PROMPT, ids, skip_special_tokens=False)[0].output_text
    assert skipped == ", there was a"
    assert kept == ", there</s> was<s> a"
    assert kept == decode_suffix(tokenizer, PROMPT, ids, skip_special_tokens=False)


@pytest.mark.parametrize("stop_str", ["girl named", "Lily.", "ittle g"])
def test_stop_string_across_tokens_is_excluded(tokenizer: Any, stop_str: str) -> None:
    detok, stop, deltas = stream(tokenizer, PROMPT, STORY, stop=["nothing", stop_str])
    expected = STORY_TEXT[: STORY_TEXT.index(stop_str)]
    assert stop == stop_str
    assert detok.output_text == expected
    assert "".join(deltas) == expected


@pytest.mark.parametrize("stop_str", ["girl named", "Lily."])
def test_stop_string_kept_with_include_stop_str_in_output(tokenizer: Any, stop_str: str) -> None:
    detok, stop, deltas = stream(
        tokenizer, PROMPT, STORY, stop=[stop_str], include_stop_str_in_output=True
    )
    expected = STORY_TEXT[: STORY_TEXT.index(stop_str) + len(stop_str)]
    assert stop == stop_str
    assert detok.output_text == expected
    assert "".join(deltas) == expected


def test_earliest_stop_string_wins(tokenizer: Any) -> None:
    detok, stop, _ = stream(tokenizer, PROMPT, STORY, stop=["Lily", "little girl"])
    assert stop == "little girl"
    assert detok.output_text == ", there was a "


def test_stop_at_the_very_first_token(tokenizer: Any) -> None:
    detok, stop, deltas = stream(tokenizer, PROMPT, STORY, stop=[","])
    assert stop == ","
    assert detok.output_text == "" and deltas == [""]
    assert detok.update([383]) == ","  # later ids are ignored
    assert detok.output_text == ""


@pytest.mark.parametrize("stop_str", ["girl named", "Lily.", "park", "day, she", "girl namex"])
def test_stream_never_contains_part_of_a_stop_string(tokenizer: Any, stop_str: str) -> None:
    expected = STORY_TEXT.split(stop_str)[0]  # the whole story when the stop never matches
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams(stop=[stop_str]))
    streamed = ""
    for token_id in STORY:
        stop = detok.update([token_id])
        streamed += detok.get_delta_text(finished=stop is not None)
        # Streamed text is final: always a prefix of the text that ends before the stop string.
        assert expected.startswith(streamed)
        if stop is not None:
            break
    streamed += detok.get_delta_text(finished=True)
    assert streamed == detok.output_text == expected


class DecodeSpy:
    """Wraps a tokenizer and records the longest id list passed to decode."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.all_special_ids = tokenizer.all_special_ids
        self.max_decoded_ids = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.max_decoded_ids = max(self.max_decoded_ids, len(ids))
        return self._tokenizer.decode(ids, **kwargs)


def test_decode_window_stays_bounded_on_long_outputs(tokenizer: Any) -> None:
    spy = DecodeSpy(tokenizer)
    cjk = [b + BYTE_OFFSET for b in "你好".encode()]
    ids = (STORY + cjk + [0xFF + BYTE_OFFSET] * 5) * 40  # ~1700 tokens with held-back bytes
    detok, _, _ = stream(spy, PROMPT, ids)
    assert detok.output_text.startswith(STORY_TEXT + "你好")
    assert spy.max_decoded_ids <= 8


def decode_suffix(tokenizer: Any, prompt: list[int], ids: list[int], **kwargs: Any) -> str:
    """The text `ids` add after `prompt` in a one-shot decode of both."""
    prompt_text = tokenizer.decode(prompt, **kwargs)
    full_text = tokenizer.decode(prompt + ids, **kwargs)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text) :]


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.sampled_from([0, BOS, EOS, *NORMAL_IDS]), max_size=8),
    ids=st.lists(st.sampled_from([0, BOS, EOS, *NORMAL_IDS]), min_size=1, max_size=40),
    skip_special_tokens=st.booleans(),
)
def test_random_normal_and_special_ids_match_one_shot_decode(
    tokenizer: Any, prompt: list[int], ids: list[int], skip_special_tokens: bool
) -> None:
    """With no byte-fallback ids, incremental text == decode(prompt + ids) minus decode(prompt);
    with a [BOS] prompt and skipped specials that is exactly tokenizer.decode(ids)."""
    params = {"skip_special_tokens": skip_special_tokens}
    detok, _, deltas = stream(tokenizer, prompt, ids, **params)
    assert detok.output_text == decode_suffix(tokenizer, prompt, ids, **params)
    assert "".join(deltas) == detok.output_text
    if skip_special_tokens:
        bos_only = stream(tokenizer, [BOS], ids)[0].output_text
        assert bos_only == tokenizer.decode(ids, skip_special_tokens=True)


# A literal U+FFFD is excluded from generated text: text ending in it is held back like a
# broken character, and dropped if the sample ends there.
NO_REPLACEMENT_CHAR = st.characters(codec="utf-8", exclude_characters="\ufffd")


@settings(max_examples=150, deadline=None)
@given(
    prompt_text=st.text(max_size=10),
    text=st.text(alphabet=st.sampled_from("ab ,.你好😀é\n"), min_size=1, max_size=20)
    | st.text(alphabet=NO_REPLACEMENT_CHAR, min_size=1, max_size=20),
)
def test_encoded_unicode_text_matches_one_shot_decode(
    tokenizer: Any, prompt_text: str, text: str
) -> None:
    """Ids of real text (byte fallback for unknown characters, so always valid UTF-8 overall):
    the incremental text equals the one-shot decode and never streams a broken character."""
    prompt = tokenizer.encode(prompt_text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, _, deltas = stream(tokenizer, prompt, ids)
    assert detok.output_text == decode_suffix(tokenizer, prompt, ids, skip_special_tokens=True)
    assert "".join(deltas) == detok.output_text
    assert "\ufffd" not in detok.output_text
