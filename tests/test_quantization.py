"""Linear methods: qiao-packed and oneDNN-packed float32 and weight-only int8, against their
references.

The int8 quality bounds are the figures `qiao bench quality` measured on the real stories260K
weights (12 prompts x 64 greedy tokens: 5/12 outputs identical, mean agreeing prefix 45.8 tokens;
perplexity 3.2207 float32 vs 3.2133 int8, -0.23 %), with a margin.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qiao import LLM, SamplingParams
from qiao.bench.quality import DEFAULT_TEXT, measure_quality, perplexity
from qiao.errors import ConfigError
from qiao.kernels import cpu_ops
from qiao.layers.linear import LinearBase
from qiao.layers.linear_method import (
    DenseMethod,
    Int8Method,
    OneDnnMethod,
    PackedF32Method,
    choose_method,
    int8_linear_reference,
    onednn_linear_available,
    packed_f32_ops,
    quantize_int8,
)

ops = cpu_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="C++ CPU kernels could not be built here")
needs_packed = pytest.mark.skipif(
    packed_f32_ops(torch.empty(1)) is None, reason="no AVX-512 build of the C++ kernels here"
)


def _layer(n: int, k: int, bias: bool, seed: int = 0) -> LinearBase:
    gen = torch.Generator().manual_seed(seed)
    layer = LinearBase(k, n, bias)
    layer.weight.data = torch.randn(n, k, generator=gen) * 0.05
    if bias:
        layer.bias.data = torch.randn(n, generator=gen)
    return layer


def test_quantize_int8_round_trip_is_within_half_a_step():
    w = torch.randn(37, 50) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different scale
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert (q.abs().amax(dim=1) == 127).all()  # each row uses its whole range
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()


@needs_ops
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(64, 64), (37, 50), (130, 577), (8, 15)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_matches_reference(rows, n, k, bias):
    # Output sizes not a multiple of the 4-row tile, inner sizes not a multiple of 16.
    layer = _layer(n, k, bias)
    q, scale = quantize_int8(layer.weight)
    x = torch.randn(rows, k).bfloat16()
    b = layer.bias.float() if bias else torch.empty(0)
    out = ops.int8_linear(x.float(), q, scale, b)
    expected = int8_linear_reference(x, q, scale, layer.bias)
    # Both round the float32 sum to bfloat16: equal but for the rare sum whose last bits fall
    # on a rounding boundary (one bfloat16 step, 2**-8 relative).
    close = torch.isclose(out, expected, atol=1e-6, rtol=1e-6)
    assert close.float().mean() >= 0.95
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=2**-7)
    exact = x.double() @ (q.double() * scale.double()[:, None]).T  # before the bias
    got = out.double() - (layer.bias.double() if bias else 0)
    assert ((got - exact).abs() <= 2**-8 * exact.abs() + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 7, 9, 64])  # both sides of the kernel / matmul switch
def test_int8_layer_keeps_int8_storage_and_matches_dequantized_linear(rows):
    layer = _layer(96, 80, bias=True)
    dense = layer.weight.detach().clone()
    layer.method = Int8Method()
    layer.method.prepare(layer)
    assert layer.weight.dtype == torch.int8 and "weight" not in dict(layer.named_parameters())
    x = torch.randn(3, rows, 80)  # leading dims are kept
    out = layer(x)
    assert out.shape == (3, rows, 96) and out.dtype == torch.float32
    q, scale = quantize_int8(dense)
    exact = F.linear(x.bfloat16().double(), q.double() * scale.double()[:, None])
    got = out.double() - layer.bias.double()  # the sum is rounded before the bias is added
    assert ((got - exact).abs() <= 2**-8 * exact.abs() + 1e-6).all()


@pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN linear")
@pytest.mark.parametrize("rows", [0, 1, 16, 200])
def test_onednn_packed_linear_matches_f_linear(rows):
    layer = _layer(96, 80, bias=True)
    dense = layer.weight.detach().clone()
    layer.method = OneDnnMethod(batch_hint=64)
    layer.method.prepare(layer)
    x = torch.randn(rows, 80)
    torch.testing.assert_close(layer(x), F.linear(x, dense, layer.bias), atol=1e-5, rtol=1e-5)


@needs_packed
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 130, 300])
@pytest.mark.parametrize("n,k", [(96, 80), (33, 17), (16, 5), (64, 1536)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_f32_linear_matches_f_linear(rows, n, k, bias):
    # Row counts around the 8-row tile and the 128-row panel; feature counts off the 32-wide block.
    layer = _layer(n, k, bias=bias)
    dense = layer.weight.detach().clone()
    layer.method = PackedF32Method(ops)
    layer.method.prepare(layer)
    assert layer.weight.shape == ((n + 31) // 32, k, 32)
    x = torch.randn(rows, k)
    torch.testing.assert_close(layer(x), F.linear(x, dense, layer.bias), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, 3, k)  # leading dims kept, as F.linear keeps them
    torch.testing.assert_close(layer(x3), F.linear(x3, dense, layer.bias), atol=1e-4, rtol=1e-5)


@needs_packed
def test_packed_f32_linear_rejects_a_mismatched_input():
    packed = ops.pack_linear_f32(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_f32(torch.randn(2, 17), packed, 40, torch.empty(0))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear_f32(torch.randn(2, 16), packed, 80, torch.empty(0))


def test_cpu_linear_method_choice(monkeypatch):
    w32 = torch.randn(8, 8)
    expected = PackedF32Method if packed_f32_ops(w32) is not None else OneDnnMethod
    if expected is OneDnnMethod and not onednn_linear_available():
        pytest.skip("neither the packed kernel nor oneDNN here")
    assert type(choose_method(w32, quantization=None, batch_hint=64)) is expected
    bf16 = choose_method(w32.bfloat16(), quantization=None, batch_hint=64)
    assert type(bf16) is (OneDnnMethod if onednn_linear_available(torch.bfloat16) else DenseMethod)
    if onednn_linear_available():
        monkeypatch.setenv("QIAO_DISABLE_PACKED_LINEAR", "1")
        assert type(choose_method(w32, quantization=None, batch_hint=64)) is OneDnnMethod
    assert type(choose_method(w32, quantization="int8", batch_hint=64)) is Int8Method


@pytest.fixture
def cpu_without_onednn_bfloat16(monkeypatch):
    """This CPU as an AVX2-only one looks to torch: oneDNN refuses to prepack bfloat16 (float32
    still prepacks). CI has run on such machines."""
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def refuse_bfloat16(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(
                "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert "
                "or avx512bw, avx512vl and avx512dq"
            )
        return reorder(weight, batch_hint)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse_bfloat16)
    onednn_linear_available.cache_clear()
    yield
    onednn_linear_available.cache_clear()


def test_bfloat16_and_int8_fall_back_where_onednn_has_no_bfloat16(
    cpu_without_onednn_bfloat16, tiny_checkpoint
):
    assert not onednn_linear_available(torch.bfloat16)
    w = torch.randn(16, 8)
    assert type(choose_method(w.bfloat16(), quantization=None, batch_hint=64)) is DenseMethod
    layer = _layer(96, 80, bias=True)
    dense = layer.weight.detach().clone()
    layer.method = choose_method(dense, quantization="int8", batch_hint=64)
    layer.method.prepare(layer)
    assert layer.weight_bf16 is None  # no prepacked copy: converted per call
    x = torch.randn(20, 80)  # past the kernel's rows: the bfloat16 matmul path
    q, scale = quantize_int8(dense)
    expected = int8_linear_reference(x.bfloat16(), q, scale, layer.bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    # A bfloat16 model loads and generates on such a CPU.
    llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", profile=None)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@needs_packed
def test_tied_float32_head_is_packed_without_touching_the_embedding(tiny_checkpoint):
    from qiao.models.arch_config import load_arch_config
    from qiao.models.loader import load_model

    path = tiny_checkpoint("qwen3")  # tied embeddings
    arch = load_arch_config(path)
    cpu = torch.device("cpu")
    model = load_model(path, arch, dtype=torch.float32, device=cpu, quantization=None)
    assert isinstance(model.lm_head.method, PackedF32Method)
    embedding = model.model.embed_tokens.weight
    assert embedding.shape == (arch.vocab_size, arch.hidden_size)
    hidden = torch.randn(5, arch.hidden_size)
    torch.testing.assert_close(
        model.lm_head(hidden), F.linear(hidden, embedding), atol=1e-4, rtol=1e-5
    )


def test_tied_head_is_converted_without_touching_the_embedding(tiny_checkpoint):
    from qiao.models.arch_config import load_arch_config
    from qiao.models.loader import load_model

    path = tiny_checkpoint("qwen3")  # tied embeddings
    arch = load_arch_config(path)
    assert arch.tie_word_embeddings
    cpu = torch.device("cpu")
    dense = load_model(path, arch, dtype=torch.float32, device=cpu, quantization=None)
    embedding = dense.model.embed_tokens.weight.detach().clone()
    model = load_model(path, arch, dtype=torch.float32, device=cpu, quantization="int8")
    assert model.lm_head.weight.dtype == torch.int8
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    q, scale = quantize_int8(embedding)
    torch.testing.assert_close(model.lm_head.weight, q)
    torch.testing.assert_close(model.lm_head.weight_scale, scale)


def test_unknown_quantization_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError, match="quantization"):
        LLM(str(tiny_checkpoint("llama")), quantization="int3", profile=None)


def test_int8_greedy_output_does_not_depend_on_the_batch(stories_dir):
    llm = LLM(str(stories_dir), quantization="int8", profile=None)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = ["Once upon a time", "Tom had a big red ball.", "The little boy was sad because"]
    prompts = prompts * 4  # 12 rows: the prefill and decode matmuls take the bf16 path
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:3]]
    assert together[:3] == alone
    assert together[3:6] == alone


def test_float32_perplexity_matches_transformers(stories_dir):
    transformers = pytest.importorskip("transformers")
    llm = LLM(str(stories_dir), dtype="float32", profile=None)
    ids = llm.get_tokenizer().encode(DEFAULT_TEXT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    nll = F.cross_entropy(logits, torch.tensor(ids[1:]))
    assert perplexity(llm, ids) == pytest.approx(math.exp(nll.item()), rel=1e-4)


def test_int8_quality_on_stories260k_stays_within_measured_bounds(stories_dir):
    report = measure_quality(str(stories_dir), "int8")
    assert report.num_prompts == 12 and report.max_tokens == 64
    assert report.perplexity_float32 == pytest.approx(3.2207, rel=1e-3)
    assert abs(report.perplexity_change) <= 0.01
    assert report.exact_match_prompts >= 4 / 12
    assert report.mean_agreeing_prefix >= 38
    assert report.token_agreement >= 0.6
