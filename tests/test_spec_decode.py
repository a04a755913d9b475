"""Speculative decoding: the n-gram proposer, the verification and rejection rules, and the
engine's output with speculation against plain decoding's, token for token.

Plain decoding is the oracle: a verifying step keeps only tokens the target itself produces, so
greedy and seeded sampled output must equal it exactly (the engines run batch-invariant, so no
floating-point near-tie can differ between a 1 + k-token verification and a 1-token decode). The
rejection rules are checked statistically: over many trials the emitted tokens follow p.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qiao import LLM, SamplingParams
from qiao.config import EngineConfig
from qiao.errors import ConfigError
from qiao.runner.sampler import inverse_cdf_sample
from qiao.spec_decode import verify
from qiao.spec_decode.ngram import (
    NgramProposer,
    find_ngram_continuation,
    find_ngram_continuation_reference,
)
from qiao.spec_decode.rejection_sampler import rejection_sample, rejection_sample_reference

# A repetitive prompt (ids below the tiny vocabulary): the lookup finds its spans again.
REPEATED = [5, 9, 14, 22, 31, 40, 52, 61, 7, 18] * 4 + [5, 9, 14]
OTHER = [100 + i for i in range(12)] * 2 + [100, 101]
LONG = [200 + (i * 7) % 90 for i in range(70)]
P_VALUE_FLOOR = 1e-3  # a correct sampler fails a chi-square test at this level 1 run in 1000


# --- n-gram lookup -----------------------------------------------------------------------------


def test_ngram_latest_occurrence_longest_suffix_first():
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3], dtype=np.int64)
    # Suffix [1, 2, 3] occurs at 0 (n = 3 wins over n = 2's later [2, 3] at 5).
    assert find_ngram_continuation(tokens, 2, 3, 3).tolist() == [4, 9, 2]
    # With n <= 2 only: the latest [2, 3] is at 5 -> [5, 6, 1].
    assert find_ngram_continuation(tokens, 2, 2, 3).tolist() == [5, 6, 1]
    # Fewer tokens than k follow the match: what there is.
    assert find_ngram_continuation(np.array([7, 8, 7]), 1, 2, 4).tolist() == [8, 7]
    assert find_ngram_continuation(np.array([1, 2, 3, 4]), 2, 3, 2).tolist() == []
    assert find_ngram_continuation(np.array([1]), 1, 3, 2).tolist() == []
    proposer = NgramProposer(4, 2, 3)
    assert proposer.propose(tokens) == [4, 9, 2, 3]
    assert proposer.propose(tokens, max_tokens=1) == [4]
    assert proposer.propose(tokens, max_tokens=0) == []


def test_ngram_lookup_matches_its_reference():
    rng = np.random.default_rng(7)
    for _ in range(3000):
        tokens = rng.integers(0, rng.integers(1, 6), rng.integers(1, 40))
        min_n = int(rng.integers(1, 4))
        max_n, k = min_n + int(rng.integers(0, 3)), int(rng.integers(1, 5))
        want = find_ngram_continuation_reference(tokens, min_n, max_n, k)
        assert find_ngram_continuation(tokens, min_n, max_n, k).tolist() == want.tolist()


def test_ngram_batch_keeps_each_requests_tokens_as_they_grow():
    from types import SimpleNamespace

    proposer = NgramProposer(3, 1, 3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, 40).tolist()
    request = SimpleNamespace(request_id="r", all_token_ids=tokens[:5], num_tokens=5)
    for length in (5, 6, 9, 30, 40):  # grows past the buffer's first size
        request.all_token_ids, request.num_tokens = tokens[:length], length
        (batch,) = proposer.propose_batch([request], [3])
        assert batch == proposer.propose(np.array(tokens[:length]), 3)
    proposer.propose_batch([], [])
    assert not proposer._tokens  # a request no longer proposed for is forgotten


def test_logit_rows_and_accepted_runs():
    assert verify.logit_rows(np.array([4, 9]), np.array([2, 0])).tolist() == [2, 3, 4, 9]
    assert verify.group_starts(np.array([2, 0, 1])).tolist() == [0, 3, 4]
    num_drafts = np.array([3, 0, 2, 1])
    drafts = [[7, 8, 9], [], [4, 4], [6]]
    sampled = torch.tensor([7, 8, 5, 2, 11, 3, 9, 4, 6, 1])
    firsts, runs = verify.accept_drafts(sampled, num_drafts, drafts)
    # [7, 8 | 5]: two accepted, then the target's 5; [11]: no drafts; [3]: none accepted;
    # [6 | 1]: every draft accepted, then the bonus token 1.
    assert firsts == [7, 11, 3, 6]
    assert runs == [[8, 5], [], [], [1]]


# --- rejection sampling ------------------------------------------------------------------------


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    total = counts.sum()
    expected = probs * total
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic.double() / 2))


def _emitted_by_position(tokens: torch.Tensor, num_accepted: torch.Tensor, vocab: int) -> list:
    """Per position j: counts of the tokens emitted there (runs that reached j)."""
    counts = []
    for j in range(tokens.shape[1]):
        reached = num_accepted >= j
        counts.append(torch.bincount(tokens[reached, j], minlength=vocab).double())
    return counts


@pytest.mark.parametrize("draft", ["random", "one_hot"])
def test_rejection_sampling_emits_the_target_distribution(draft):
    """p is the same at every position, so each emitted token, wherever the run ends, is ~ p."""
    vocab, k, trials = 6, 3, 200_000
    gen = torch.Generator().manual_seed(1234)
    p = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, dim=0)
    q = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, dim=0)
    target = p.expand(trials, k + 1, vocab)
    if draft == "random":
        draft_ids = torch.multinomial(q, trials * k, replacement=True, generator=gen)
        draft_ids = draft_ids.view(trials, k)
        draft_probs = q.expand(trials, k, vocab)
    else:  # a lookup proposal: fixed tokens, probability 1
        draft_ids = torch.tensor([[1, 3, 1]]).expand(trials, k)
        draft_probs = None
    tokens, num_accepted = rejection_sample(
        target,
        draft_ids,
        torch.full((trials,), k),
        torch.rand(trials, k, generator=gen),
        torch.rand(trials, generator=gen),
        draft_probs,
    )
    for counts in _emitted_by_position(tokens, num_accepted, vocab):
        assert _chi_square_p_value(counts, p.double()) > P_VALUE_FLOOR
    # The acceptance rate is the overlap sum(min(p, q)) (one-hot: p(x)).
    expected = torch.minimum(p, q).sum() if draft == "random" else p[1]
    assert abs(float((num_accepted > 0).double().mean()) - float(expected)) < 0.01


def test_engine_rule_for_proposals_emits_the_target_distribution():
    """The engine's rule for lookup proposals (`verify.accept_drafts`: the target's own
    inverse-CDF sample at each position, kept while it equals the draft) is rejection sampling
    with q one-hot: its tokens follow p too."""
    vocab, k, trials = 6, 3, 100_000
    gen = torch.Generator().manual_seed(99)
    p = torch.softmax(torch.randn(vocab, generator=gen), dim=0)
    sampled = inverse_cdf_sample(
        p.expand(trials * (k + 1), vocab), torch.rand(trials * (k + 1), generator=gen)
    )
    drafts = [[2, 0, 2]] * trials
    firsts, runs = verify.accept_drafts(sampled, np.full(trials, k), drafts)
    first = torch.tensor(firsts)
    assert _chi_square_p_value(torch.bincount(first, minlength=vocab).double(), p.double()) > (
        P_VALUE_FLOOR
    )
    second = torch.tensor([run[0] for run in runs if run])
    assert _chi_square_p_value(torch.bincount(second, minlength=vocab).double(), p.double()) > (
        P_VALUE_FLOOR
    )
    assert abs(len(second) / trials - float(p[2])) < 0.01


@pytest.mark.parametrize("draft", ["random", "one_hot"])
def test_rejection_sampler_matches_its_reference(draft):
    vocab, k, num = 7, 4, 64
    gen = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn(num, k + 1, vocab, generator=gen) * 2, dim=-1)
    num_drafts = torch.randint(0, k + 1, (num,), generator=gen)
    draft_ids = torch.randint(0, vocab, (num, k), generator=gen)
    draft_probs = None
    if draft == "random":
        draft_probs = torch.softmax(torch.randn(num, k, vocab, generator=gen) * 2, dim=-1)
    accept_u = torch.rand(num, k, generator=gen)
    recover_u = torch.rand(num, generator=gen)
    tokens, num_accepted = rejection_sample(
        target, draft_ids, num_drafts, accept_u, recover_u, draft_probs
    )
    lists = [draft_ids[i, : int(num_drafts[i])].tolist() for i in range(num)]
    expected = rejection_sample_reference(target, lists, accept_u, recover_u, draft_probs)
    got = [row[row >= 0].tolist() for row in tokens]
    assert got == expected
    assert (num_accepted == torch.tensor([len(e) - 1 for e in expected])).all()


# --- the engine --------------------------------------------------------------------------------


class OracleProposer(NgramProposer):
    """Proposes plain decoding's own continuation (from reference runs), wrong at one position in
    two steps out of three: full, partial and empty accepted runs all occur."""

    def __init__(self, references: list[list[int]], k: int) -> None:
        super().__init__(k, 1, 1)
        self.references = references
        self.k = k
        self.calls = 0

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
        tokens = token_ids.tolist()
        self.calls += 1
        for ref in self.references:
            if len(ref) > len(tokens) and ref[: len(tokens)] == tokens:
                drafts = ref[len(tokens) : len(tokens) + min(self.k, max_tokens or self.k)]
                wrong = self.calls % 3 - 1  # -1: none wrong, else that position
                if 0 <= wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % 300
                return drafts
        return []


def _llm(path, spec: bool, **kwargs) -> LLM:
    extra = {"speculative_method": "ngram", "num_speculative_tokens": 4} if spec else {}
    return LLM(str(path), max_num_seqs=8, batch_invariant=True, **extra, **kwargs)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def plain(tiny):
    return _llm(tiny, spec=False)


@pytest.fixture(scope="module")
def spec(tiny):
    return _llm(tiny, spec=True)


PROMPTS = [REPEATED, OTHER, REPEATED[3:], LONG]


def test_ngram_greedy_identical_to_plain_several_requests(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    before = spec.engine.stats()["spec_decode_num_draft_tokens"]
    expected = _tokens(plain.generate(PROMPTS, params, use_tqdm=False))
    assert _tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == expected
    assert spec.engine.stats()["spec_decode_num_draft_tokens"] > before


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_accepted_runs_identical_to_plain(plain, spec, mode):
    """Drafts that are mostly right (plain decoding's own tokens) exercise long accepted runs; a
    seeded sampled run with penalties and min_tokens keeps plain decoding's tokens too."""
    if mode == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    else:
        params = SamplingParams(
            temperature=0.9,
            top_k=40,
            top_p=0.9,
            repetition_penalty=1.2,
            presence_penalty=0.3,
            min_tokens=8,
            seed=17,
            max_tokens=30,
        )
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    references = [o.prompt_token_ids + o.outputs[0].token_ids for o in expected]
    engine = spec.engine
    original = engine.speculator.proposer
    engine.speculator.proposer = OracleProposer(references, 4)
    stats = engine.speculator.stats
    accepted_before, drafts_before = stats.num_accepted_tokens, stats.num_drafts
    try:
        got = spec.generate(PROMPTS, params, use_tqdm=False)
        again = spec.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.speculator.proposer = original
    assert _tokens(got) == _tokens(expected)
    assert _tokens(again) == _tokens(expected)
    assert [o.outputs[0].finish_reason for o in got] == [
        o.outputs[0].finish_reason for o in expected
    ]
    # Runs of up to 4 accepted drafts happened: several tokens per step.
    assert stats.num_accepted_tokens - accepted_before > stats.num_drafts - drafts_before
    assert stats.num_accepted_tokens_per_pos[3] > 0


def test_stops_inside_an_accepted_run(plain, spec):
    """A stop string, a stop token and max_tokens landing inside a run of accepted drafts end
    the output exactly where plain decoding ends it."""
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    (reference,) = plain.generate([REPEATED], free, use_tqdm=False)
    text, ids = reference.outputs[0].text, reference.outputs[0].token_ids
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[text[14:20]]),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[ids[13]]),
        SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    ]
    engine = spec.engine
    original = engine.speculator.proposer
    engine.speculator.proposer = OracleProposer([reference.prompt_token_ids + ids], 4)
    try:
        for params in cases:
            (want,) = plain.generate([REPEATED], params, use_tqdm=False)
            (got,) = spec.generate([REPEATED], params, use_tqdm=False)
            w, g = want.outputs[0], got.outputs[0]
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
                w.token_ids,
                w.text,
                w.finish_reason,
                w.stop_reason,
            ), params
    finally:
        engine.speculator.proposer = original


def test_verification_shares_a_step_with_a_chunked_prefill(tiny):
    """A small token budget: one request's 1 + k verification runs beside another's prompt
    chunks; both outputs equal plain decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = []
    for use_spec in (False, True):
        llm = _llm(tiny, spec=use_spec, max_num_batched_tokens=16)
        engine = llm.engine
        if use_spec:  # drafts that are mostly right, so verification goes on through the prefill
            references = [
                prompt + results[0][0][rid].outputs[0].token_ids
                for rid, prompt in (("a", REPEATED), ("b", LONG))
            ]
            engine.speculator.proposer = OracleProposer(references, 4)
        steps = []
        schedule = engine.scheduler.schedule

        def recording_schedule(schedule=schedule, steps=steps):
            out = schedule()
            steps.append(out)
            return out

        engine.scheduler.schedule = recording_schedule
        engine.add_request("a", REPEATED, params)
        done = {}
        for _ in range(3):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.add_request("b", LONG, params)
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        results.append((done, steps))
    (plain_out, _), (spec_out, steps) = results
    assert {k: v.outputs[0].token_ids for k, v in spec_out.items()} == {
        k: v.outputs[0].token_ids for k, v in plain_out.items()
    }
    mixed = [
        s
        for s in steps
        if any(item.spec_token_ids for item in s.scheduled)
        and any(not item.sample for item in s.scheduled)
    ]
    assert mixed, "no step verified drafts beside a prompt chunk"
    assert all(s.num_scheduled_tokens <= 16 for s in steps)


def test_logprob_requests_do_not_speculate(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    drafts_before = spec.engine.stats()["spec_decode_num_drafts"]
    (want,) = plain.generate([REPEATED], params, use_tqdm=False)
    (got,) = spec.generate([REPEATED], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].logprobs == want.outputs[0].logprobs
    assert spec.engine.stats()["spec_decode_num_drafts"] == drafts_before


def test_stories_greedy_and_seeded_identical(stories_dir):
    """The real stories260K model, default (not batch-invariant) kernels."""
    plain = LLM(str(stories_dir), max_num_seqs=4)
    spec = LLM(str(stories_dir), max_num_seqs=4, speculative_method="ngram")
    prompts = ["Once upon a time there was a little fox. Once upon a time", "The dog"]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=48),
        SamplingParams(temperature=0.8, seed=3, max_tokens=48),
    ):
        want = _tokens(plain.generate(prompts, params, use_tqdm=False))
        assert _tokens(spec.generate(prompts, params, use_tqdm=False)) == want
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_metrics_export_the_counters(spec):
    from prometheus_client import CollectorRegistry, generate_latest

    from qiao.api.metrics import _EngineCollector

    class Served:
        model, version, engine = "tiny", "1", spec.engine

    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: [Served()], lambda: []))
    text = generate_latest(registry).decode()
    stats = spec.engine.stats()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        line = f'qiao:spec_decode_{key}_total{{model_name="tiny",version="1"}}'
        assert f"{line} {float(stats[f'spec_decode_{key}'])}" in text


def test_config_errors_name_the_setting(tiny):
    with pytest.raises(ConfigError, match="speculative_method"):
        EngineConfig.create(str(tiny), speculative_method="medusa")
    with pytest.raises(ConfigError, match="prompt_lookup_max"):
        EngineConfig.create(
            str(tiny), speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2
        )
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.create(str(tiny), speculative_method="ngram", num_speculative_tokens=0)
    config = EngineConfig.create(str(tiny), speculative_method="ngram")
    assert EngineConfig.from_dict(config.to_dict()) == config


# --- draft model -------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_arch", ["llama", "qwen2"])
def test_draft_model_greedy_identical_to_plain(tiny_checkpoint, plain, draft_arch):
    """Draft = the target itself (every draft accepted) or another tiny model with the same
    vocabulary; several requests at once, one of them sampled with a seed."""
    draft = LLM(
        str(tiny_checkpoint("llama")),
        max_num_seqs=8,
        batch_invariant=True,
        speculative_method="draft",
        speculative_model=str(tiny_checkpoint(draft_arch)),
        num_speculative_tokens=3,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=30, ignore_eos=True)
    for params in (greedy, seeded):
        expected = _tokens(plain.generate(PROMPTS, params, use_tqdm=False))
        stats_before = draft.engine.speculator.stats.as_dict()
        assert _tokens(draft.generate(PROMPTS, params, use_tqdm=False)) == expected
        stats = draft.engine.speculator.stats.as_dict()
        proposed = (
            stats["spec_decode_num_draft_tokens"] - stats_before["spec_decode_num_draft_tokens"]
        )
        accepted = (
            stats["spec_decode_num_accepted_tokens"]
            - stats_before["spec_decode_num_accepted_tokens"]
        )
        assert proposed > 0
        if draft_arch == "llama" and params is greedy:
            assert accepted == proposed  # the target's own argmax, every time
    proposer = draft.engine.speculator.proposer
    assert not proposer.sequences  # finished requests' draft copies were dropped
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


def test_draft_model_must_share_the_vocabulary(tiny, stories_dir):
    with pytest.raises(ConfigError, match="speculative_model: its vocabulary"):
        LLM(str(tiny), speculative_method="draft", speculative_model=str(stories_dir))
    with pytest.raises(ConfigError, match="speculative_model"):
        EngineConfig.create(str(tiny), speculative_method="draft")
    with pytest.raises(ConfigError, match="speculative_model"):
        EngineConfig.create(str(tiny), speculative_method="ngram", speculative_model=str(tiny))


def test_grammar_requests_decode_beside_speculating_ones(stories_dir):
    """Constrained requests do not speculate; in a step with verifying rows their masks still
    land on their own rows, and every output equals plain decoding's."""
    pytest.importorskip("llguidance")
    prompt = "Once upon a time there was a little fox. Once upon a time"
    params = [
        SamplingParams(temperature=0.0, max_tokens=32),
        SamplingParams(
            temperature=1.0, seed=6, max_tokens=20, structured_outputs={"regex": "[a-c]{4}-[0-9]+"}
        ),
        SamplingParams(temperature=0.8, seed=2, max_tokens=32),
        SamplingParams(
            temperature=0.0, max_tokens=10, structured_outputs={"choice": ["Tom", "Sue"]}
        ),
    ]
    plain = LLM(str(stories_dir), max_num_seqs=8)
    spec = LLM(str(stories_dir), max_num_seqs=8, speculative_method="ngram")
    want = plain.generate([prompt] * 4, params, use_tqdm=False)
    got = spec.generate([prompt] * 4, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert spec.engine.stats()["spec_decode_num_drafts"] > 0
