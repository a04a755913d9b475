import math
import random

import pytest
import torch

from qiao.runner.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    apply_penalties,
    hash32,
    uniform_from_hash,
)
from qiao.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 2


def row(
    seed: int = 0,
    num_generated: int = 0,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **params: object,
) -> SamplingRow:
    """A row whose generation index is `num_generated` (or len(output) when output is given)."""
    generated = output if output is not None else range(num_generated)
    return SamplingRow(SamplingParams(**params), seed, prompt or [], generated, [EOS])


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    metadata = SamplingMetadata.from_rows(rows, logits.shape[-1], CPU)
    return Sampler()(logits, metadata)


def random_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_skips_randomness() -> None:
    logits = random_logits(16, 1000)
    metadata = SamplingMetadata.from_rows([row(temperature=0.0)] * 16, 1000, CPU)
    assert metadata.all_greedy and metadata.seed_lo is None and metadata.top_p is None
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_input_logits_are_not_modified() -> None:
    logits = random_logits(4, 100)
    before = logits.clone()
    rows = [
        row(seed=i, output=[1, 2], repetition_penalty=1.5, top_p=0.5, min_tokens=3)
        for i in range(4)
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(32, 500)
    out = sample(logits, [row(seed=i, top_k=1, temperature=1.5) for i in range(32)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_tiny_top_p_equals_greedy() -> None:
    logits = random_logits(32, 500)
    out = sample(logits, [row(seed=i, top_p=1e-6) for i in range(32)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_mixed_greedy_and_random_rows() -> None:
    logits = random_logits(8, 500)
    rows = [row(seed=i, temperature=0.0 if i % 2 else 5.0) for i in range(8)]
    out = sample(logits, rows).sampled_token_ids
    greedy = logits.argmax(dim=-1)
    assert torch.equal(out[1::2], greedy[1::2])
    alone = sample(logits[0::2], rows[0::2]).sampled_token_ids
    assert torch.equal(out[0::2], alone)


def test_min_p_keeps_only_tokens_near_the_top() -> None:
    # probs [0.5, 0.3, 0.15, 0.05]; min_p 0.35 -> threshold 0.175 -> only tokens 0 and 1 survive.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(2000, 4)
    rows = [row(seed=7, num_generated=i, min_p=0.35) for i in range(2000)]
    counts = torch.bincount(sample(logits, rows).sampled_token_ids, minlength=4)
    assert counts[2] == 0 and counts[3] == 0
    assert abs(counts[0].item() / 2000 - 0.5 / 0.8) < 0.05
    without = torch.bincount(
        sample(logits, [row(seed=7, num_generated=i) for i in range(2000)]).sampled_token_ids,
        minlength=4,
    )
    assert without[2] > 0 and without[3] > 0


def test_penalties_match_hand_computed_reference() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]] * 2)
    penalized = row(
        prompt=[0, 1],
        output=[2, 2, 3],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    plain = row(prompt=[0, 1], output=[2, 2, 3])
    metadata = SamplingMetadata.from_rows([penalized, plain], 6, CPU)
    out = apply_penalties(logits, metadata)
    # Repetition over prompt + output {0, 1, 2, 3}: 2/2, -1*2, 0.5/2, -0.5*2.
    # Then output counts {2: 2, 3: 1}: token 2 -= 0.5 + 2 * 0.25, token 3 -= 0.5 + 0.25.
    expected = torch.tensor([1.0, -2.0, 0.25 - 1.0, -1.0 - 0.75, 1.0, 3.0])
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], logits[1])


def test_presence_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.9]])
    assert sample(logits, [row(temperature=0.0, output=[1])]).sampled_token_ids.item() == 1
    penalized = row(temperature=0.0, output=[1], presence_penalty=0.5)
    assert sample(logits, [penalized]).sampled_token_ids.item() == 2


def test_min_tokens_bans_eos_and_stop_token_ids() -> None:
    eos_best = [0.0, 1.0, 3.0, 0.0, 2.0]  # EOS (2) best, stop token 4 second, token 1 third
    stop_best = [0.0, 1.0, 2.0, 0.0, 3.0]  # stop token 4 best, EOS second
    logits = torch.tensor([eos_best, eos_best, stop_best, stop_best, eos_best])
    rows = [
        row(temperature=0.0, num_generated=1, min_tokens=2, stop_token_ids=[4]),
        row(temperature=0.0, num_generated=2, min_tokens=2, stop_token_ids=[4]),  # min reached
        row(temperature=0.0, num_generated=0, min_tokens=2, stop_token_ids=[4]),
        # EOS does not end an ignore_eos request, so only the stop token is banned.
        row(temperature=0.0, num_generated=0, min_tokens=2, ignore_eos=True, stop_token_ids=[4]),
        row(seed=3, num_generated=0, min_tokens=1, stop_token_ids=[4], top_k=1),
    ]
    assert sample(logits, rows).sampled_token_ids.tolist() == [1, 2, 1, 2, 1]


def test_seeded_sampling_is_reproducible() -> None:
    logits = random_logits(1, 1000).expand(4, 1000)
    rows = [row(seed=12345, num_generated=7)] * 4
    first = sample(logits, rows).sampled_token_ids
    assert first.unique().numel() == 1
    assert torch.equal(sample(logits, rows).sampled_token_ids, first)


def test_seeded_sampling_is_batch_invariant() -> None:
    logits = random_logits(16, 2000)
    rows = [row(seed=1000 + i, num_generated=i, top_p=0.9, top_k=100 * (i % 3)) for i in range(16)]
    full = sample(logits, rows).sampled_token_ids
    order = list(range(16))
    random.Random(0).shuffle(order)
    shuffled = sample(logits[order], [rows[i] for i in order]).sampled_token_ids
    assert torch.equal(shuffled, full[order])
    for i in (0, 5, 15):
        assert sample(logits[i : i + 1], [rows[i]]).sampled_token_ids.item() == full[i].item()
    # Greedy neighbours and other features in the batch do not change a random row either.
    extra = row(temperature=0.0, repetition_penalty=1.3, output=[1, 2], logprobs=3, min_p=0.1)
    mixed = sample(torch.cat([logits[:1], logits[3:4]]), [extra, rows[3]]).sampled_token_ids
    assert mixed[1].item() == full[3].item()


def test_different_seeds_and_steps_give_different_tokens() -> None:
    logits = torch.zeros(64, 1000)
    by_seed = sample(logits, [row(seed=s, num_generated=3) for s in range(64)]).sampled_token_ids
    by_step = sample(logits, [row(seed=5, num_generated=i) for i in range(64)]).sampled_token_ids
    assert by_seed.unique().numel() > 50 and by_step.unique().numel() > 50


def test_seed_accepts_any_python_int() -> None:
    logits = torch.zeros(3, 1000)
    out = sample(logits, [row(seed=s) for s in (-1, 2**64 - 1, 2**80 + 12345)])
    assert (
        out.sampled_token_ids.tolist()[:2]
        == sample(logits[:2], [row(seed=2**64 - 1)] * 2).sampled_token_ids.tolist()
    )
    assert out.sampled_token_ids[2].item() != out.sampled_token_ids[0].item()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize(
    ("params", "support"),
    [({"temperature": 0.7}, 8), ({"temperature": 1.3, "top_k": 3}, 3), ({"top_p": 0.6}, None)],
)
def test_sample_frequencies_match_the_filtered_softmax(params: dict, support: int | None) -> None:
    num_samples = 4000
    base = torch.tensor([1.0, 0.5, 0.2, 0.0, -0.3, -0.5, -1.0, -2.0])
    temperature = float(params.get("temperature", 1.0))
    probs = torch.softmax(base / temperature, dim=-1)
    if support is None:
        # top_p 0.6 over probs sorted descending: the smallest prefix with mass >= 0.6.
        mass_before = probs.cumsum(-1) - probs
        support = int((mass_before < params["top_p"]).sum())
    probs[support:] = 0
    probs /= probs.sum()
    rows = [row(seed=99, num_generated=i, **params) for i in range(num_samples)]
    sampled = sample(base.expand(num_samples, 8), rows).sampled_token_ids
    counts = torch.bincount(sampled, minlength=8).float()
    assert counts[support:].sum() == 0
    # Critical value of chi-square with <= 7 degrees of freedom at p = 0.001 is 24.3.
    assert _chi_square(counts, probs) < 24.3


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = random_logits(6, 300)
    rows = [
        row(seed=i, temperature=2.0, repetition_penalty=1.5, output=[3], logprobs=i % 3 or None)
        for i in range(6)
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprob_token_ids.shape == (6, 3) and out.logprobs.shape == (6, 3)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top = raw.topk(2, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = (order == out.sampled_token_ids.unsqueeze(1)).int().argmax(dim=-1) + 1
    assert torch.equal(out.sampled_ranks, expected_ranks)
    assert out.sampled_ranks.max() > 1


def test_greedy_logprobs_rank_one() -> None:
    logits = random_logits(3, 50)
    out = sample(logits, [row(temperature=0.0, logprobs=0)] * 3)
    assert out.logprobs.shape == (3, 1)
    assert out.sampled_ranks.tolist() == [1, 1, 1]


def test_hash32_matches_python_reference() -> None:
    def reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    rng = random.Random(0)
    values = [0, 1, 2**31, 2**32 - 1, *(rng.getrandbits(32) for _ in range(2000))]
    assert hash32(torch.tensor(values)).tolist() == [reference(v) for v in values]


def test_uniforms_stay_strictly_inside_the_unit_interval() -> None:
    uniform = uniform_from_hash(torch.tensor([0, 2**31, 2**32 - 1]))
    assert uniform.dtype == torch.float32
    assert 0.0 < uniform[0] < 1e-6 and 1.0 - 1e-6 < uniform[2] < 1.0
    noise = -torch.log(uniform)
    assert bool((noise > 0).all() and noise.isfinite().all())


def test_a_big_mixed_batch_samples_every_row() -> None:
    """64 rows over a 50k vocabulary, each mixing greedy and sampled decoding, top-p/top-k/min-p,
    penalties, logprobs and min_tokens, sample in one call: one token per row, finite logprobs, and
    the same tokens again for the same seeds. (Its speed is a benchmark's business: `qiao bench
    latency` times whole steps.)"""
    vocab_size = 50_000
    logits = random_logits(64, vocab_size)
    rows = [
        row(
            seed=i,
            output=list(range(i, i + 50)),
            prompt=list(range(200)),
            temperature=0.0 if i % 4 == 0 else 0.8,
            top_p=0.9 if i % 2 else 1.0,
            top_k=40 if i % 3 == 0 else -1,
            min_p=0.05 if i % 5 == 0 else 0.0,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            logprobs=5 if i % 2 else None,
            min_tokens=60,
            max_tokens=100,
        )
        for i in range(64)
    ]
    out = sample(logits, rows)
    assert out.sampled_token_ids.shape == (64,)
    assert not math.isnan(out.logprobs.sum().item())
    again = sample(logits, rows)
    assert torch.equal(out.sampled_token_ids, again.sampled_token_ids)  # seeded rows repeat


@pytest.mark.parametrize("path", ["kernel", "candidates"])
def test_top_p_cutoff_equals_full_sort(path):
    from qiao.kernels import cpu_ops
    from qiao.runner.sampler import _candidate_cutoff, _sorted_cutoff, _top_k_top_p_cutoff

    if path == "kernel" and (cpu_ops() is None or not cpu_ops().sample_rows_available()):
        pytest.skip("the C++ sampling kernel is not built here")

    vocab = 5000
    g = torch.Generator().manual_seed(5)
    peaked = torch.randn(6, vocab, generator=g) * 12  # nucleus within the first candidates
    flat = torch.randn(6, vocab, generator=g) * 0.1  # nucleus far wider: full-sort fallback
    logits = torch.cat([peaked, flat])
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.7, 0.95] * 2)
    for top_k in (None, torch.tensor([5, 300, vocab, 40, vocab, 1] * 2)):
        if path == "kernel":
            fast = _top_k_top_p_cutoff(logits, top_k, vocab, top_p)
        else:
            fast = _candidate_cutoff(logits, top_k, top_p)
        full = _sorted_cutoff(logits.sort(dim=-1, descending=True).values, top_k, top_p)
        # Same kept set (a keep-everything row may report -inf instead of its smallest logit).
        assert torch.equal(logits < fast, logits < full)


def _torch_draws(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, ...]:
    """The PyTorch path's draws, with each row's CDF and uniform (the kernel's reference)."""
    from qiao.runner.sampler import apply_min_p, apply_top_k_top_p, row_uniforms

    scaled = logits.float() / metadata.temperature.unsqueeze(1)
    scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.max_top_k, metadata.top_p)
    if metadata.min_p is not None:
        scaled = apply_min_p(scaled, metadata.min_p)
    probs = scaled.double().softmax(dim=-1)
    uniforms = row_uniforms(metadata).double()
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, uniforms.unsqueeze(1)).squeeze(1), cdf, uniforms, probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.8},
        {"temperature": 1.0},
        {"temperature": 0.6, "top_k": 40},
        {"temperature": 1.1, "top_p": 0.9},
        {"temperature": 0.7, "top_k": 100, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.05},
        {"temperature": 0.9, "top_p": 0.95, "min_p": 0.02},
    ],
)
def test_the_fused_kernel_draws_what_the_pytorch_path_draws(dtype, params) -> None:
    from qiao.runner.sampler import fused_sample

    logits = random_logits(256, 1000, seed=7).to(dtype)
    rows = [row(seed=1000 + i, num_generated=i % 5, **params) for i in range(256)]
    metadata = SamplingMetadata.from_rows(rows, 1000, CPU)
    fused = fused_sample(logits, metadata)
    if fused is None:
        pytest.skip("the C++ sampling kernel is not built here")
    expected, cdf, uniforms, probs = _torch_draws(logits, metadata)
    assert bool((probs.gather(1, fused.unsqueeze(1)) > 0).all())  # never a filtered token
    for i in (fused != expected).nonzero().flatten().tolist():
        # Sums in another order: a draw may differ only where u sits on a token's boundary.
        lo, hi = sorted((int(fused[i]), int(expected[i])))
        assert abs(float(cdf[i, lo]) - float(uniforms[i])) < 1e-5, (i, lo, hi)
    assert (fused == expected).float().mean() > 0.99


def test_the_fused_kernel_on_a_grid_of_uniforms_gives_the_softmax_counts() -> None:
    from qiao.kernels import cpu_ops

    ops = cpu_ops()
    if ops is None or not ops.sample_rows_available():
        pytest.skip("the C++ sampling kernel is not built here")
    n = 20000
    base = torch.tensor([2.0, -1.0, 0.5, float("-inf"), 0.0, 1.5, -3.0, 0.25] * 3)
    temperature, cutoff = 0.8, -0.5 / 0.8  # keeps the tokens whose logit is >= -0.5
    uniforms = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    draws = ops.sample_rows(
        base.expand(n, -1).contiguous(),
        torch.full((n,), temperature),
        torch.full((n,), cutoff),
        uniforms,
    )
    scaled = base / temperature
    probs = torch.where(scaled >= cutoff, scaled, -math.inf).double().softmax(-1)
    counts = torch.bincount(draws, minlength=base.numel()).double()
    # Uniforms on a grid walk the CDF evenly: each token gets its share to within a draw or two.
    assert (counts - n * probs).abs().max() <= 2
    assert counts[probs == 0].sum() == 0


def test_top_p_cutoff_keeps_tied_tokens_together() -> None:
    from qiao.runner.sampler import _top_k_top_p_cutoff

    logits = torch.tensor([[1.0, 3.0, 0.0, 3.0, 1.0], [1.0, 3.0, 0.0, 3.0, 1.0]])
    top_p = torch.tensor([0.3, 0.9])
    # p = 0.3: the first 3.0 alone (0.43 of the mass) reaches it; its twin is kept with it.
    # p = 0.9: both 3.0s (0.86) fall short, so the 1.0s join as a tied pair.
    cutoff = _top_k_top_p_cutoff(logits, None, 5, top_p)
    assert cutoff.flatten().tolist() == [3.0, 1.0]


def test_top_k_cutoff_kernel_equals_torch_topk() -> None:
    from qiao.kernels import cpu_ops

    ops = cpu_ops()
    if ops is None or not ops.sample_rows_available():
        pytest.skip("the C++ sampling kernel is not built here")
    logits = random_logits(6, 3000, seed=3)
    logits[1, :50] = 2.5  # repeats counted: the 10th largest of a run of equal values
    logits[2, 7] = float("-inf")
    top_k = torch.tensor([1, 10, 2999, 3000, 5000, 17])
    expected = logits.topk(2999, dim=-1).values.gather(1, top_k.clamp(max=2999)[:, None] - 1)
    expected[top_k >= 3000] = -math.inf
    assert torch.equal(ops.top_k_cutoff_rows(logits, top_k).unsqueeze(1), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprob_kernel_equals_log_softmax_topk_and_ranks(dtype, k) -> None:
    from qiao.kernels import cpu_ops

    ops = cpu_ops()
    if ops is None or not ops.sample_rows_available():
        pytest.skip("the C++ sampling kernel is not built here")
    logits = random_logits(8, 5000, seed=k).to(dtype)
    logits[3, 100:140] = logits[3].max() + 1  # 40 tied leaders: any 20 of them are the top 20
    sampled = torch.tensor([0, 17, 4999, 120, 2500, 3, 4000, 42])
    ids, logprobs, ranks = ops.logprob_rows(logits, sampled, k)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(ids[:, 0], sampled)
    torch.testing.assert_close(logprobs[:, 0], reference.gather(1, sampled[:, None])[:, 0])
    assert torch.equal(ranks, (reference > reference.gather(1, sampled[:, None])).sum(-1) + 1)
    if k:
        top = reference.topk(k, dim=-1).values
        torch.testing.assert_close(logprobs[:, 1:], top)  # the k largest, largest first
        torch.testing.assert_close(reference.gather(1, ids[:, 1:]), top)  # ids that hold them
        assert all(len(set(row.tolist())) == k for row in ids[:, 1:])
        assert ids[3, 1:].min() >= 100 and ids[3, 1:].max() < 140
