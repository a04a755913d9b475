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


def _smaps_entry(address: int) -> str:
    """The /proc/self/smaps entry of the mapping holding `address`."""
    import re

    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in block.split(None, 1)[0].split("-"))
        if lo <= address < hi:
            return block
    raise AssertionError(f"{address:#x} is not in /proc/self/smaps")


def _resident_bytes(address: int) -> int:
    import re

    rss = re.search(r"^Rss:\s+(\d+) kB", _smaps_entry(address), re.M)
    assert rss is not None
    return int(rss.group(1)) * 1024


def test_cpu_zeros_can_take_transparent_huge_pages() -> None:
    import os

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text() or not os.path.exists("/proc/self/smaps"):
        pytest.skip("transparent huge pages are off (or unreadable) on this host")
    pool = platform.zeros((2**22,), torch.float32, torch.device("cpu"))  # 16 MiB
    # The mapping holding the pool must be eligible: a shared anonymous mapping (shmem) is
    # not where the host's shmem_enabled is "never", and every first touch costs a 4 KiB fault.
    block = _smaps_entry(pool.data_ptr())
    assert "THPeligible:           1" in block, block


def test_prefault_makes_the_pool_resident_in_the_given_order() -> None:
    import os

    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc here to read the resident size from")
    from qiao.runner.model_runner import _prefault_order

    # Two layers' pools of 64 blocks x 16 tokens x 2 heads x 64 float32 (8 KiB a block).
    caches = [platform.zeros((2, 64, 16, 2, 64), torch.float32, torch.device("cpu")) for _ in "ab"]
    order = _prefault_order(caches)
    block = 8192
    # Block order first, then layer, then K before V: every layer's first blocks come first.
    assert order[:4] == [(0, 0, 64 * block), (0, 64 * block, 64 * block)] + [
        (1, 0, 64 * block),
        (1, 64 * block, 64 * block),
    ]
    covered = sum(length for _, _, length in order)
    assert covered == 2 * caches[0].numel() * 4
    before = [_resident_bytes(c.data_ptr()) for c in caches]
    thread = platform.prefault_in_background(caches, order)
    if thread is None:
        pytest.skip("no background prefault on this platform")
    thread.join(timeout=30)
    after = [_resident_bytes(c.data_ptr()) for c in caches]
    if after == before:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert all(a >= c.numel() * 4 for a, c in zip(after, caches, strict=True))
    assert not caches[0].any()  # faulted in, not written


def test_prefault_stops_when_the_pool_is_freed() -> None:
    from collections.abc import Sequence

    class Endless(Sequence[tuple[int, int, int]]):
        """A billion 4 KiB ranges over the pool's first 64 MiB: hours of work if never stopped."""

        def __len__(self) -> int:
            return 10**9

        def __getitem__(self, i):  # type: ignore[override]
            if i >= len(self):
                raise IndexError(i)
            return (0, (i % 2**14) * 4096, 4096)

    pool = platform.zeros((2**24,), torch.float32, torch.device("cpu"))  # 64 MiB
    thread = platform.prefault_in_background([pool], Endless())
    if thread is None:
        pytest.skip("no background prefault on this platform")
    del pool
    thread.join(timeout=10)
    assert not thread.is_alive()


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


def test_engine_faults_the_whole_pool_in_before_any_request(tiny_checkpoint) -> None:
    import os

    from qiao.entrypoints.llm import LLM

    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc here to read the resident size from")
    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=256, device="cpu")
    runner = llm.engine.runner
    thread = runner.prefault_thread
    if thread is None:
        pytest.skip("no background prefault on this platform")
    thread.join(timeout=30)
    assert not thread.is_alive()
    # Every layer's pool resident, with no request served yet.
    assert llm.engine.num_steps == 0
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    if (major, minor) < (5, 14):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    resident = [_resident_bytes(c.data_ptr()) for c in runner.kv_caches]
    assert all(r >= c.nbytes for r, c in zip(resident, runner.kv_caches, strict=True))


def test_kv_prefault_off_leaves_the_pool_to_first_use(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qiao.entrypoints.llm import LLM

    monkeypatch.setenv("QIAO_KV_PREFAULT", "0")
    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=64, device="cpu")
    assert llm.engine.runner.prefault_thread is None


def test_serve_start_up_heap_is_frozen_and_collection_restored() -> None:
    import gc

    from qiao.api.server import freeze_startup_heap
    from qiao.cli import main

    # A refused start (bad port) runs with collection off until the settings fail, then
    # restores it: an in-process caller keeps a working collector.
    assert main(["serve", "--port", "70000"]) != 0
    assert gc.isenabled()
    before = gc.get_freeze_count()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > before  # full collections no longer rescan these
    finally:
        gc.unfreeze()


def test_cpu_engine_gets_its_kernels_while_loading(tiny_checkpoint, monkeypatch) -> None:
    """The C++ kernels are found (or compiled) before the engine exists, so a server's readiness
    means its first request will not wait for a compiler."""
    import threading

    from qiao.engine import llm_engine
    from qiao.entrypoints.llm import LLM
    from qiao.kernels import cpu_ops

    asked: list[str] = []

    def recording_cpu_ops():
        asked.append(threading.current_thread().name)
        return cpu_ops()

    monkeypatch.setattr(llm_engine, "cpu_ops", recording_cpu_ops)
    LLM(str(tiny_checkpoint("llama")), num_kv_blocks=64, device="cpu")
    # Once, on a loader thread beside the weights.
    assert len(asked) == 1 and asked[0].startswith("qiao-loader")


def test_concurrent_kernel_requests_share_one_build() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from qiao.kernels import cpu_ops

    with ThreadPoolExecutor(4) as pool:
        modules = list(pool.map(lambda _: cpu_ops(), range(8)))
    assert all(m is modules[0] for m in modules)


def test_kernel_build_key_follows_the_instruction_set_only() -> None:
    from qiao.kernels import _cpu_id

    def cpuinfo(flags: str) -> str:
        line = f"flags\t\t: fpu sse sse2 avx avx2 fma {flags}"
        return f"processor\t: 0\nmodel name\t: AMD EPYC\n{line}\n\nprocessor\t: 1\n{line}\n"

    base = _cpu_id(cpuinfo("hypervisor md_clear tsc_known_freq"))
    # A VM's mitigation and hypervisor bits come and go; the code built here still runs.
    assert _cpu_id(cpuinfo("tsc_known_freq")) == base
    assert _cpu_id(cpuinfo("hypervisor arch_capabilities flush_l1d")) == base
    # An extension the compiler would use is a different build.
    assert _cpu_id(cpuinfo("hypervisor avx512f avx512bw")) != base
    assert _cpu_id(cpuinfo("")) == b"avx avx2 fma sse sse2"
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve\n"
    assert _cpu_id(arm) == b"aes asimd evtstrm fp sve"
