"""Turn a batch of last-token logits into one token per row, each row under its own params.

Order of operations (vLLM / OpenAI / HF conventions):
1. Logprobs are `log_softmax` of the raw logits, computed only when some row asks for them.
2. Penalties on the raw logits: repetition (HF: over prompt + output tokens, positive logits
   divided, negative multiplied), then presence / frequency (OpenAI: over output tokens only).
3. `min_tokens`: rows that have generated fewer tokens get their EOS and stop token ids banned.
4. Greedy rows take the argmax. Random rows: temperature, top-k, top-p, min-p, then sample.

Seeded sampling is counter-based, so a row's token depends only on (seed, generation index,
logits row), never on the batch around it. Each row draws one uniform
u = hash32(seed, generation index) in (0, 1) (a 32-bit integer finaliser computed with plain
int64 tensor ops; its top 23 bits) and takes the token where the row's cumulative probability,
in vocabulary order, first reaches u (inverse-CDF sampling: token v is chosen with probability
probs[v] / sum(probs)). No generator state is shared between rows or steps, one uniform per row
is all the randomness a step needs, and a random batch needs no host round trip for it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from qiao.kernels import ops_for
from qiao.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
# A uniform keeps the top 23 bits of a hash: with the half-step offset below, every value is
# exact in float32's 24-bit significand, so none rounds to 1.0 (which would make -log(u) = 0).
_UNIFORM_BITS = 23
_EMPTY = torch.empty(0)  # an absent per-row argument of the C++ kernels


@dataclass
class SamplingRow:
    """What the runner knows about one row to sample."""

    params: SamplingParams
    seed: int  # always set: the engine draws one when the user gave none
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; its length is the generation index
    eos_token_ids: Sequence[int]


@dataclass
class SamplingMetadata:
    """Per-row sampling settings as tensors on the logits' device.

    A feature's tensor is None when no row in the batch uses it, so its cost is skipped entirely.
    Disabled rows inside an enabled feature hold the neutral value noted beside the field.
    """

    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None  # [B] bool; None unless the batch mixes greedy and random
    temperature: torch.Tensor | None  # [B] float32; 1.0 in greedy rows; None when all greedy
    top_k: torch.Tensor | None  # [B] int64; vocab_size when disabled
    max_top_k: int  # the largest enabled top_k; 0 when top_k is None
    top_p: torch.Tensor | None  # [B] float32; 1.0 when disabled
    min_p: torch.Tensor | None  # [B] float32; 0.0 when disabled
    repetition_penalty: torch.Tensor | None  # [B] float32; 1.0 when disabled
    presence_penalty: torch.Tensor | None  # [B] float32; 0.0 when disabled
    frequency_penalty: torch.Tensor | None  # [B] float32; 0.0 when disabled
    # Set with repetition_penalty: [B, V] bool, True where the token is in the prompt or output.
    seen_token_mask: torch.Tensor | None
    # Set with presence/frequency penalty: [B, V] float32, occurrences in the output.
    output_token_counts: torch.Tensor | None
    seed_lo: torch.Tensor | None  # [B] int64 in [0, 2**32): low half of the seed mod 2**64
    seed_hi: torch.Tensor | None  # [B] int64 in [0, 2**32): high half
    generation_index: torch.Tensor | None  # [B] int64: tokens generated so far
    # min_tokens ban as (row, token id) pairs, both [N] int64; None when nothing is banned.
    banned_rows: torch.Tensor | None
    banned_token_ids: torch.Tensor | None
    max_num_logprobs: int | None  # K = max over rows of params.logprobs; None when none asks

    @property
    def modifies_logits(self) -> bool:
        """Whether a penalty or a ban changes some row's logits before sampling."""
        return (
            self.repetition_penalty is not None
            or self.output_token_counts is not None
            or self.banned_rows is not None
        )

    @property
    def transforms_logits(self) -> bool:
        """Whether a row needs more than the raw logits' argmax or sample: logprobs, a
        penalty or a ban."""
        return self.max_num_logprobs is not None or self.modifies_logits

    @classmethod
    def from_rows(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        params = [row.params for row in rows]
        greedy = [p.is_greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        penalties = _PenaltyTensors.from_rows(rows, vocab_size, device)
        banned_rows, banned_token_ids = _min_tokens_ban(rows, vocab_size, device)
        wants_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        metadata = cls(
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None,
            temperature=None,
            top_k=None,
            max_top_k=0,
            top_p=None,
            min_p=None,
            repetition_penalty=penalties.repetition,
            presence_penalty=penalties.presence,
            frequency_penalty=penalties.frequency,
            seen_token_mask=penalties.seen_token_mask,
            output_token_counts=penalties.output_token_counts,
            seed_lo=None,
            seed_hi=None,
            generation_index=None,
            banned_rows=banned_rows,
            banned_token_ids=banned_token_ids,
            max_num_logprobs=max(wants_logprobs) if wants_logprobs else None,
        )
        if not all_greedy:
            metadata._set_random_fields(rows, greedy, vocab_size, device)
        return metadata

    def _set_random_fields(
        self, rows: Sequence[SamplingRow], greedy: list[bool], vocab_size: int, device: torch.device
    ) -> None:
        params = [row.params for row in rows]
        if not self.all_random:
            self.is_greedy = torch.tensor(greedy, dtype=torch.bool, device=device)
        temperatures = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
        self.temperature = _floats(temperatures, None, device)
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        self.max_top_k = max((k for k in top_k if k < vocab_size), default=0)
        if self.max_top_k:
            self.top_k = torch.tensor(top_k, dtype=torch.int64, device=device)
        self.top_p = _floats([p.top_p for p in params], 1.0, device)
        self.min_p = _floats([p.min_p for p in params], 0.0, device)
        seeds = [row.seed % 2**64 for row in rows]
        self.seed_lo = torch.tensor([s & _MASK32 for s in seeds], dtype=torch.int64, device=device)
        self.seed_hi = torch.tensor([s >> 32 for s in seeds], dtype=torch.int64, device=device)
        generated = [len(row.output_token_ids) for row in rows]
        self.generation_index = torch.tensor(generated, dtype=torch.int64, device=device)


@dataclass
class _PenaltyTensors:
    repetition: torch.Tensor | None
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    seen_token_mask: torch.Tensor | None
    output_token_counts: torch.Tensor | None

    @classmethod
    def from_rows(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
    ) -> _PenaltyTensors:
        params = [row.params for row in rows]
        repetition = _floats([p.repetition_penalty for p in params], 1.0, device)
        presence = _floats([p.presence_penalty for p in params], 0.0, device)
        frequency = _floats([p.frequency_penalty for p in params], 0.0, device)
        seen = None if repetition is None else _seen_token_mask(rows, vocab_size, device)
        counts = None
        if presence is not None or frequency is not None:
            counts = _output_token_counts(rows, vocab_size, device)
        return cls(repetition, presence, frequency, seen, counts)


def _floats(
    values: list[float], neutral: float | None, device: torch.device
) -> torch.Tensor | None:
    """[B] float32 of `values`, or None when every value is the neutral one."""
    if neutral is not None and all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32, device=device)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # [B, 1 + K] int64: column 0 the sampled token, then the top-K ids (most likely first).
    logprob_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None  # [B, 1 + K] float32, matching logprob_token_ids
    sampled_ranks: torch.Tensor | None  # [B] int64: rank of the sampled token, 1 = most likely


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V] (float32 or the model's dtype); the input
        tensor is never modified.

        A batch with no penalties or bans samples from the logits as they are: a bfloat16 value
        converts to float32 exactly, so the argmax and the draw are the same, and no float32
        copy of the whole [B, V] matrix is made (on the Qwen2.5-0.5B vocabulary 39 MB for 64
        rows, page-faulted in afresh each step). Logprobs, of the raw logits, come from one C++
        pass per row on the CPU (`logprob_rows`: the log-sum-exp, the sampled token's value
        and rank, the top k) instead of a [B, V] log_softmax. Penalties and bans run in
        float32."""
        if not metadata.transforms_logits:
            return SamplerOutput(self._sample(logits, metadata), None, None, None)
        raw = logits
        raw_logprobs = None
        k = metadata.max_num_logprobs
        kernels = None if k is None else _row_kernels(raw, (torch.float32, torch.bfloat16))
        if k is not None and kernels is None:
            raw_logprobs = torch.log_softmax(raw.to(torch.float32), dim=-1)
        if metadata.modifies_logits:
            logits = apply_penalties(logits.to(torch.float32), metadata)
            if metadata.banned_rows is not None:
                banned = (metadata.banned_rows, metadata.banned_token_ids)
                logits = logits.index_put(banned, torch.tensor(-math.inf, device=logits.device))
        sampled = self._sample(logits, metadata)
        if k is None:
            return SamplerOutput(sampled, None, None, None)
        if kernels is not None:
            ids, logprobs, ranks = kernels.logprob_rows(raw, sampled.contiguous(), k)
            return SamplerOutput(sampled, ids, logprobs, ranks)
        assert raw_logprobs is not None
        return _gather_logprobs(raw_logprobs, sampled, k)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.all_greedy:
            return greedy_tokens(logits)
        assert metadata.temperature is not None
        sampled = fused_sample(logits, metadata)
        if sampled is None:
            scaled = logits.float() / metadata.temperature.unsqueeze(1)
            scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.max_top_k, metadata.top_p)
            if metadata.min_p is not None:
                scaled = apply_min_p(scaled, metadata.min_p)
            sampled = inverse_cdf_sample(scaled.softmax(dim=-1), row_uniforms(metadata))
        if metadata.all_random:
            return sampled
        return torch.where(metadata.is_greedy, greedy_tokens(logits), sampled)


def fused_sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
    """The random rows' draws through the C++ kernel (`sample_rows`), or None where it does not
    run (not on the CPU, another dtype, no AVX-512 build).

    The same draw as the PyTorch path, `inverse_cdf_sample(softmax(masked logits / t), u)`,
    without its [B, V] intermediates (scaled, masked, probabilities, CDF): the kernel divides
    by the temperature, leaves out the tokens below the row's cutoff, and walks the running sum
    of exp(s - max) to u times the total. Top-k, top-p and min-p reduce to that cutoff, on
    logits scaled here once (top-k / top-p as `apply_top_k_top_p`; min-p's threshold, max +
    log(min_p), then the larger of the two). Sums run in another order than PyTorch's, so a
    draw can differ only where u falls within float32 rounding of a token's boundary."""
    ops = _row_kernels(logits, (torch.float32, torch.bfloat16))
    if ops is None:
        return None
    assert metadata.temperature is not None
    source, temperature, cutoff = logits, metadata.temperature, None
    if metadata.top_k is not None or metadata.top_p is not None or metadata.min_p is not None:
        source = logits.float() / metadata.temperature.unsqueeze(1)
        temperature = _EMPTY
        cutoff = top_k_top_p_cutoff(source, metadata.top_k, metadata.max_top_k, metadata.top_p)
        if metadata.min_p is not None:
            floor = source.amax(dim=-1, keepdim=True) + torch.log(metadata.min_p).unsqueeze(1)
            cutoff = floor if cutoff is None else torch.maximum(cutoff, floor)
    row_cutoff = _EMPTY if cutoff is None else cutoff.squeeze(1).contiguous()
    return ops.sample_rows(source, temperature.contiguous(), row_cutoff, row_uniforms(metadata))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's argmax, the first index of its largest value (a NaN counting as
    largest), as `logits.argmax(dim=-1)`. On the CPU in float32 or bfloat16 the C++ kernel's one
    pass per row (`argmax_rows`): 19x PyTorch's in bfloat16, which it reduces through float32
    element by element (64 x 151936 logits, 2 cores: 0.9 against 17 ms)."""
    ops = _row_kernels(logits, (torch.float32, torch.bfloat16), vectorised=False)
    if ops is not None:
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _row_kernels(
    logits: torch.Tensor, dtypes: tuple[torch.dtype, ...], vectorised: bool = True
) -> ModuleType | None:
    """The C++ row kernels where they take `logits`: on the CPU, [B, V > 0] with contiguous
    rows, a dtype of `dtypes`, and (`vectorised`) an AVX-512 build; else None."""
    ops = ops_for(logits)
    if (
        ops is None
        or logits.dim() != 2
        or logits.dtype not in dtypes
        or logits.shape[-1] == 0
        or logits.stride(-1) != 1
    ):
        return None
    return ops if not vectorised or ops.sample_rows_available() else None


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty (HF) over prompt + output, then presence/frequency (OpenAI) over output."""
    if metadata.repetition_penalty is not None:
        penalty = metadata.repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(metadata.seen_token_mask, penalized, logits)
    counts = metadata.output_token_counts
    if counts is not None:
        if metadata.frequency_penalty is not None:
            logits = logits - metadata.frequency_penalty.unsqueeze(1) * counts
        if metadata.presence_penalty is not None:
            logits = logits - metadata.presence_penalty.unsqueeze(1) * (counts > 0)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf every token outside the row's top-k, then outside its top-p nucleus.

    Both keep a prefix of the tokens sorted by logit, so each row reduces to a cutoff logit;
    tokens tied with the cutoff are all kept.
    """
    cutoff = top_k_top_p_cutoff(logits, top_k, max_top_k, top_p)
    if cutoff is None:
        return logits
    return logits.masked_fill(logits < cutoff, -math.inf)


def top_k_top_p_cutoff(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor | None:
    """[B, 1] the smallest logit `apply_top_k_top_p` keeps in each row, or None (neither set)."""
    if top_p is not None:
        return _top_k_top_p_cutoff(logits, top_k, max_top_k, top_p)
    if top_k is not None:
        return _top_k_cutoff(logits, top_k, max_top_k)
    return None


def _top_k_cutoff(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """[B, 1] k-th largest logit (-inf where k covers the vocabulary): on the CPU in float32 by
    the C++ kernel's exact bisection over each row (`top_k_cutoff_rows`: 32 counting passes),
    elsewhere from one partial top-k instead of a full sort."""
    ops = _row_kernels(logits, (torch.float32,))
    if ops is not None:
        return ops.top_k_cutoff_rows(logits, top_k.contiguous()).unsqueeze(1)
    top_values = logits.topk(max_top_k, dim=-1).values
    cutoff = top_values.gather(1, top_k.clamp(max=max_top_k).unsqueeze(1) - 1)
    disabled = (top_k >= logits.shape[-1]).unsqueeze(1)
    return cutoff.masked_fill(disabled, -math.inf)


# Top-p first looks for its nucleus among this many most likely tokens (one partial top-k); a
# row whose nucleus is wider falls back to a full sort. Trained models nearly always fit.
_TOP_P_CANDIDATES = 256


def _top_k_top_p_cutoff(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor
) -> torch.Tensor:
    """[B, 1] smallest logit kept by top-k and then by top-p (over the top-k renormalised).

    On the CPU in float32: top-k's cutoff, then the C++ kernel's exact search of each row for
    the top-p cutoff over the tokens top-k keeps (`top_p_cutoff_rows`: the weights once, then
    32 bisection passes over the row instead of a sort). Elsewhere `_candidate_cutoff`."""
    ops = _row_kernels(logits, (torch.float32,))
    if ops is not None:
        floor = _EMPTY
        if top_k is not None:
            floor = _top_k_cutoff(logits, top_k, max_top_k).squeeze(1).contiguous()
        cutoff = ops.top_p_cutoff_rows(logits, floor, top_p.contiguous())
        # p = 1 keeps every token top-k keeps: its cutoff (or -inf) rather than the row's least.
        keep_all = floor if top_k is not None else torch.full_like(cutoff, -math.inf)
        return torch.where(top_p >= 1.0, keep_all, cutoff).unsqueeze(1)
    return _candidate_cutoff(logits, top_k, top_p)


def _candidate_cutoff(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """`_top_k_top_p_cutoff` in PyTorch: the nucleus looked for among the most likely tokens
    first, rows whose nucleus is wider sorted in full."""
    vocab_size = logits.shape[-1]
    num_candidates = min(_TOP_P_CANDIDATES, vocab_size)
    if num_candidates == vocab_size:
        return _sorted_cutoff(logits.sort(dim=-1, descending=True).values, top_k, top_p)
    candidates = logits.topk(num_candidates, dim=-1).values
    full_total = logits.logsumexp(dim=-1)
    # A row is exact on the candidates when its top-k lies inside them, or (no top-k) when the
    # candidates already hold its nucleus mass p < 1. Others (rare) are sorted in full.
    if top_k is None:
        small_k = torch.zeros_like(top_p, dtype=torch.bool)
        no_k = torch.ones_like(small_k)
        total = full_total
        kept = candidates
    else:
        small_k = top_k <= num_candidates
        no_k = top_k >= vocab_size
        in_top_k = torch.arange(num_candidates, device=logits.device) < top_k.unsqueeze(1)
        kept = candidates.masked_fill(~in_top_k, -math.inf)
        total = torch.where(small_k, kept.logsumexp(dim=-1), full_total)
    mass = (candidates - full_total.unsqueeze(1)).exp().sum(dim=-1)
    keeps_all = no_k & (top_p >= 1.0)
    fits = small_k | keeps_all | (no_k & (mass >= top_p))
    cutoff = _sorted_cutoff(kept, top_k, top_p, total=total)
    cutoff = cutoff.masked_fill(keeps_all.unsqueeze(1), -math.inf)
    if bool(fits.all()):
        return cutoff
    rows = (~fits).nonzero().squeeze(1)
    full = _sorted_cutoff(
        logits[rows].sort(dim=-1, descending=True).values,
        None if top_k is None else top_k[rows],
        top_p[rows],
    )
    return cutoff.index_copy(0, rows, full)


def _sorted_cutoff(
    sorted_logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cutoff from a row's most likely logits in descending order (all of them, or a prefix
    whose normaliser `total` (logsumexp of the kept distribution) is given)."""
    width = sorted_logits.shape[-1]
    num_kept = torch.full_like(top_p, width, dtype=torch.int64)
    if top_k is not None:
        rank = torch.arange(width, device=sorted_logits.device)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), -math.inf)
        num_kept = top_k.clamp(max=width)
    if total is None:
        probs = sorted_logits.softmax(dim=-1)
    else:
        probs = (sorted_logits - total.unsqueeze(1)).exp()
    # A token stays while the mass ranked strictly before it is below p, so the nucleus is the
    # smallest prefix reaching p. E.g. p = 0.5, probs [0.4, 0.3, 0.3] -> mass before
    # [0, 0.4, 0.7] -> 2 kept. Rows with p = 1 skip this: rounding can push a tail token's mass
    # before it to 1.
    mass_before = probs.cumsum(dim=-1) - probs
    num_in_nucleus = (mass_before < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    num_kept = torch.where(top_p < 1.0, torch.minimum(num_kept, num_in_nucleus), num_kept)
    return sorted_logits.gather(1, num_kept.unsqueeze(1) - 1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability.

    In logit space: p_v < min_p * p_max  <=>  logit_v < logit_max + log(min_p); min_p = 0 gives
    a threshold of -inf, which masks nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, -math.inf)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One categorical draw per row: the first token whose cumulative probability reaches u.

    E.g. probs [0.2, 0.0, 0.5, 0.3], u = 0.6 -> cdf [0.2, 0.2, 0.7, 1.0] -> token 2. A token of
    probability 0 never wins: its cdf equals its predecessor's, which is found first.
    """
    cdf = probs.cumsum(dim=-1)
    target = uniforms.unsqueeze(1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, target).squeeze(1)
    return index.clamp(max=probs.shape[-1] - 1)


def row_uniforms(metadata: SamplingMetadata) -> torch.Tensor:
    """[B] uniforms in (0, 1) that are a pure function of (seed, generation index)."""
    assert metadata.seed_lo is not None and metadata.seed_hi is not None
    assert metadata.generation_index is not None
    key = hash32(metadata.seed_lo ^ hash32(metadata.seed_hi ^ hash32(metadata.generation_index)))
    return uniform_from_hash(hash32(key ^ 0x5BD1E995))


def uniform_from_hash(x: torch.Tensor) -> torch.Tensor:
    """float32 uniforms strictly inside (0, 1) from 32-bit hashes.

    E.g. top bits 0 -> u = 2**-24; top bits 2**23 - 1 -> u = 1 - 2**-24.
    """
    bits = x >> (32 - _UNIFORM_BITS)
    return (bits.to(torch.float32) + 0.5) * (2.0**-_UNIFORM_BITS)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer finaliser (lowbias32 constants) of int64 values, mod 2**32.

    Each multiplier c > 2**31 is applied as c - 2**32 (equal mod 2**32), so a product of x in
    [0, 2**32) stays within (-2**63, 2**63): int64 never overflows, and masking the product to 32
    bits before each right shift keeps every shifted value non-negative.
    """
    x = x & _MASK32
    x ^= x >> 16
    x.mul_(_signed_mul(0x7FEB352D)).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_signed_mul(0x846CA68B)).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def _signed_mul(constant: int) -> int:
    """The multiplier in [-2**31, 2**31) congruent to `constant` mod 2**32."""
    return constant - 2**32 if constant >= 2**31 else constant


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> SamplerOutput:
    sampled_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1))
    top_logprobs, top_ids = raw_logprobs.topk(k, dim=-1)
    ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprob_token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),
        sampled_ranks=ranks,
    )


def _flat_token_index(
    token_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) pairs of ragged per-row lists, for one scatter over a [B, V] tensor.

    E.g. [[5, 7], [], [7]] -> rows [0, 0, 2], token ids [5, 7, 7].
    """
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    token_ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    return rows.to(device), token_ids.to(device)


def _seen_token_mask(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> torch.Tensor:
    seen = [[*row.prompt_token_ids, *row.output_token_ids] for row in rows]
    row_idx, token_ids = _flat_token_index(seen, device)
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    return mask.index_put_((row_idx, token_ids), torch.tensor(True, device=device))


def _output_token_counts(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> torch.Tensor:
    row_idx, token_ids = _flat_token_index([row.output_token_ids for row in rows], device)
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(token_ids.shape, dtype=torch.float32, device=device)
    return counts.index_put_((row_idx, token_ids), ones, accumulate=True)


def _min_tokens_ban(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Token ids that would stop a row still short of min_tokens.

    Those are its stop_token_ids plus its EOS ids unless ignore_eos (EOS then does not stop it).
    """
    banned = [_stopping_token_ids(row, vocab_size) for row in rows]
    if not any(banned):
        return None, None
    return _flat_token_index(banned, device)


def _stopping_token_ids(row: SamplingRow, vocab_size: int) -> list[int]:
    if len(row.output_token_ids) >= row.params.min_tokens:
        return []
    eos = () if row.params.ignore_eos else row.eos_token_ids
    return [t for t in {*eos, *row.params.stop_token_ids} if t < vocab_size]
