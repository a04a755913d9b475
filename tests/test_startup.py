"""What makes a server start quickly: the lazily zeroed CPU KV pool and the tokenizer shortcut."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from qiao.hal import platform
from qiao.tokenizer import load_tokenizer

DEMO_DIR = Path(__file__).resolve().parents[1] / "qiao" / "demo_model"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_zeros_are_zero_aligned_and_writable(dtype: torch.dtype) -> None:
    shape = (2, 33, 16, 3, 64)
    kv = platform.zeros(shape, dtype, torch.device("cpu"))
    assert kv.shape == shape and kv.dtype == dtype and kv.is_contiguous()
    assert kv.data_ptr() % 64 == 0
    assert not kv.any()
    kv[1, 32, 15] = 1.5
    assert kv.sum().item() == 1.5 * 3 * 64


def test_cpu_zeros_keep_their_memory_alive_and_take_pages_on_first_touch() -> None:
    import gc
    import os

    assert platform.zeros((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)

    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc here to read the resident size from")
    before = rss()
    pool = platform.zeros((2**28,), torch.float32, torch.device("cpu"))  # 1 GiB
    assert rss() - before < 2**27  # untouched: not resident
    view = pool[-4:]
    del pool
    gc.collect()
    view.fill_(2.0)  # the mapping outlives the tensor it was made for
    assert view.sum().item() == 8.0


def test_cpu_zeros_can_take_transparent_huge_pages() -> None:
    import os
    import re

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text() or not os.path.exists("/proc/self/smaps"):
        pytest.skip("transparent huge pages are off (or unreadable) on this host")
    pool = platform.zeros((2**22,), torch.float32, torch.device("cpu"))  # 16 MiB
    start = pool.data_ptr()
    # The mapping holding the pool must be eligible: a shared anonymous mapping (shmem) is
    # not where the host's shmem_enabled is "never", and every first touch costs a 4 KiB fault.
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in block.split(None, 1)[0].split("-"))
        if lo <= start < hi:
            assert "THPeligible:           1" in block, block
            return
    pytest.fail("the pool's mapping is not in /proc/self/smaps")


def test_generic_fast_tokenizer_skips_auto_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR), local_files_only=True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("AutoTokenizer was used for a PreTrainedTokenizerFast checkpoint")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    tokenizer = load_tokenizer(DEMO_DIR)
    text = "Good morrow! What news, my lord?"
    assert tokenizer.encode(text) == expected.encode(text)
    assert tokenizer.eos_token_id == expected.eos_token_id
    assert tokenizer.chat_template == expected.chat_template


def test_other_tokenizer_classes_still_go_through_auto_tokenizer(stories_dir: Path) -> None:
    # stories260K names LlamaTokenizer: AutoTokenizer builds it, as before.
    tokenizer = load_tokenizer(stories_dir)
    expected = transformers.AutoTokenizer.from_pretrained(str(stories_dir), local_files_only=True)
    assert type(tokenizer) is type(expected)
    assert tokenizer.encode("Once upon a time") == expected.encode("Once upon a time")
