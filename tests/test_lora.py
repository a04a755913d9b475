"""Multi-LoRA against PEFT: every adapter's output equals PEFT's merged model (transformers).

Tiny PEFT adapters are built with peft itself (`init_lora_weights=False`, so B is not zero) on
the tiny random checkpoints; the reference is `PeftModel.from_pretrained(...).merge_and_unload()`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qiao.config import EngineConfig, parse_lora_modules
from qiao.entrypoints.llm import LLM
from qiao.errors import ConfigError, ModelNotFoundError
from qiao.lora import LoRARequest
from qiao.lora.manager import LoRAManager
from qiao.lora.slots import LoRAContext, LoRASlots, build_plan, lora_reference
from qiao.lora.steps import merge_outputs
from qiao.sampling_params import SamplingParams
from qiao.step import ModelRunnerOutput

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
MAX_TOKENS = 8
PROMPTS = [
    [1, 17, 42, 99, 5, 23, 61, 7, 150, 3, 88, 200, 14, 9, 31, 77, 4, 250, 12, 6],
    [1, 300, 2, 45, 45, 45, 8, 19],
    [1, 64, 128, 32, 16, 8, 4, 2, 111, 222, 33, 44],
]
# name -> (LoraConfig arguments, seed): different ranks, targets and scalings.
ADAPTERS = {
    "all": (
        dict(
            r=4,
            lora_alpha=8,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
        ),
        1,
    ),
    "qv_rs": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True), 2),
    "mlp": (dict(r=2, lora_alpha=4, target_modules=["up_proj", "down_proj", "o_proj"]), 3),
}


def _build_adapter(base_dir: Path, out_dir: Path, config: dict, seed: int) -> Path:
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(
        base, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **config)
    )
    with torch.no_grad():  # PEFT's default init is large for a tiny model: keep it near 0.3x
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(0.5)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base_dir(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp(f"adapters-{base_dir.name}")
    return {
        name: LoRARequest(name, i + 1, str(_build_adapter(base_dir, root / name, cfg, seed)))
        for i, (name, (cfg, seed)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def reference(base_dir, adapters):
    """reference(adapter name or None, prompt) -> (greedy tokens, log-softmax [L, vocab] over
    prompt + tokens), from PEFT's merged model."""
    models = {None: transformers.AutoModelForCausalLM.from_pretrained(base_dir)}
    for name, lora in adapters.items():
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        models[name] = peft.PeftModel.from_pretrained(base, lora.lora_path).merge_and_unload()
    cache: dict = {}

    @torch.no_grad()
    def run(name: str | None, prompt: list[int]):
        key = (name, tuple(prompt))
        if key not in cache:
            model = models[name].eval()
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
            )
            tokens = out[0, len(prompt) :].tolist()
            logprobs = torch.log_softmax(model(out).logits[0].float(), dim=-1)
            cache[key] = tokens, logprobs
        return cache[key]

    return run


def _llm(base_dir: Path, **kwargs) -> LLM:
    options = dict(
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=8,
        profile=None,
    )
    return LLM(str(base_dir), **{**options, **kwargs})


def _params() -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )


def _check(output, name: str | None, prompt: list[int], reference) -> None:
    """Greedy tokens equal the merged model's; the logprob of every prompt token and of every
    sampled token equal its log-softmax."""
    tokens, logprobs = reference(name, prompt)
    sample = output.outputs[0]
    assert sample.token_ids == tokens, f"adapter {name}: greedy tokens differ"
    ours = [
        entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)
    ]
    theirs = logprobs[np.arange(len(prompt) - 1), prompt[1:]]
    torch.testing.assert_close(torch.tensor(ours), theirs, atol=ATOL, rtol=0)
    ours = [entry[t].logprob for entry, t in zip(sample.logprobs, tokens, strict=True)]
    positions = np.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    torch.testing.assert_close(torch.tensor(ours), logprobs[positions, tokens], atol=ATOL, rtol=0)


def test_mixed_batch_equals_peft_merged(base_dir, adapters, reference):
    """One batch: two adapters of different ranks and the base model, decoded together (the
    grouped path), with the third adapter's prompt as well."""
    llm = _llm(base_dir)
    names = ["all", None, "qv_rs"]
    outputs = llm.generate(PROMPTS, _params(), lora_request=[adapters.get(n) for n in names])
    for output, name, prompt in zip(outputs, names, PROMPTS, strict=True):
        _check(output, name, prompt, reference)
    # The adapters change the output (else the test would prove nothing).
    assert reference("all", PROMPTS[0])[0] != reference(None, PROMPTS[0])[0]
    outputs = llm.generate(
        PROMPTS, _params(), lora_request=[adapters["mlp"], adapters["all"], adapters["mlp"]]
    )
    for output, name, prompt in zip(outputs, ["mlp", "all", "mlp"], PROMPTS, strict=True):
        _check(output, name, prompt, reference)


def test_lru_with_one_slot_evicts_and_reloads(base_dir, adapters, reference):
    """max_loras=1, max_cpu_loras=1: a batch of three adapters runs in parts, each adapter
    evicted and loaded again from its folder, and every output is still PEFT's."""
    llm = _llm(base_dir, max_loras=1, max_cpu_loras=1)
    names = ["all", "qv_rs", "mlp"]
    loras = [adapters[n] for n in names]
    for _ in range(2):
        outputs = llm.generate(PROMPTS, _params(), lora_request=loras)
        for output, name, prompt in zip(outputs, names, PROMPTS, strict=True):
            _check(output, name, prompt, reference)
    manager = llm.engine.runner.lora
    assert manager.num_slot_evictions >= 4
    assert len(manager.cpu_cache) == 1 and len(manager.slots) == 1
    # Two slots (none and one adapter) of 2 layers x 4 LoRA layers, counted as weights.
    assert manager.slot_bytes() == sum(
        (t.numel() * 4) for layer in manager.layers.values() for t in (layer.lora_a, layer.lora_b)
    )
    assert len(manager.layers) == 8 and all(len(x.ranks) == 2 for x in manager.layers.values())
    assert llm.engine.memory_bytes()["weights"] > manager.slot_bytes() > 0


def test_prefix_cache_is_not_shared_across_adapters(base_dir, adapters, reference):
    """The same prompt under the base model, then an adapter, then the base again: the
    adapter's run hits none of the base's blocks, the base's second run hits its own."""
    llm = _llm(base_dir)
    bm = llm.engine.block_manager
    prompt = PROMPTS[0] * 3  # 60 tokens: three full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], params)
    hits = bm.num_hit_tokens
    under_adapter = llm.generate([prompt], params, lora_request=adapters["all"])
    assert bm.num_hit_tokens == hits
    llm.generate([prompt], params)
    assert bm.num_hit_tokens == hits + 48
    again = llm.generate([prompt], params, lora_request=adapters["all"])
    assert bm.num_hit_tokens == hits + 96
    assert again[0].outputs[0].token_ids == under_adapter[0].outputs[0].token_ids
    assert under_adapter[0].outputs[0].token_ids == reference("all", prompt)[0][:2]


def test_grouped_equals_reference():
    """The grouped path against the per-token gather, slots in any order, ranks and parts
    padded, a slot that does not adapt the layer."""
    torch.manual_seed(0)
    context = LoRAContext()
    layer = LoRASlots(
        context,
        input_size=24,
        part_sizes=[16, 8, 8],
        num_slots=4,
        max_lora_rank=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    layer.set_slot(1, {0: (torch.randn(3, 24), torch.randn(16, 3))})
    layer.set_slot(
        2, {0: (torch.randn(4, 24), torch.randn(16, 4)), 2: (torch.randn(4, 24), torch.randn(8, 4))}
    )
    layer.set_slot(3, None)
    slots = np.array([2, 0, 1, 3, 2, 1])
    lens = np.array([3, 2, 1, 4, 2, 5])
    x = torch.randn(int(lens.sum()), 24)
    context.plan = build_plan(slots, lens, torch.device("cpu"))
    y = layer.apply(x, torch.zeros(len(x), 32))
    expected = lora_reference(x, layer.lora_a, layer.lora_b, context.plan.token_slots)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert context.plan.offset is None  # slot 1's tokens are apart: gathered
    # Sequences grouped by adapter (the base model's first): slices, no gather.
    slots, lens = np.array([0, 1, 1, 2]), np.array([2, 3, 1, 2])
    x = torch.randn(int(lens.sum()), 24)
    context.plan = build_plan(slots, lens, torch.device("cpu"))
    assert context.plan.offset == 2
    y = layer.apply(x, torch.ones(len(x), 32))
    expected = 1 + lora_reference(x, layer.lora_a, layer.lora_b, context.plan.token_slots)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert build_plan(np.zeros(3, np.int64), np.array([1, 2, 3]), torch.device("cpu")) is None
    context.plan = None
    assert layer.apply(x, torch.ones(len(x), 32)).eq(1).all()


def test_split_and_merge():
    a, b, c = (LoRARequest(n, i + 1, f"/{n}") for i, n in enumerate("abc"))
    manager = LoRAManager.__new__(LoRAManager)
    manager.config = EngineConfig.create("m", enable_lora=True, max_loras=2).lora
    assert manager.split([a, None, b, a]) is None
    assert manager.split([a, None, b, c, a]) == [[0, 1, 2, 4], [3]]
    merged = merge_outputs(
        [
            ModelRunnerOutput(req_ids=["x"], sampled_token_ids=[1]),
            ModelRunnerOutput(
                req_ids=["y"], sampled_token_ids=[2], logprobs=[([2], [-0.1])], sampled_ranks=[1]
            ),
        ]
    )
    assert merged.req_ids == ["x", "y"] and merged.sampled_token_ids == [1, 2]
    assert merged.logprobs == [None, ([2], [-0.1])]


def test_unknown_adapter_and_bad_adapters(base_dir, adapters, tmp_path):
    llm = _llm(base_dir)
    with pytest.raises(ModelNotFoundError, match="'nope' is not loaded"):
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(), lora_request="nope")
    too_big = _llm(base_dir, max_lora_rank=4)
    with pytest.raises(ConfigError, match=r"rank 8 .* above max_lora_rank 4"):
        too_big.generate([PROMPTS[0]], SamplingParams(max_tokens=1), lora_request=adapters["qv_rs"])
    # DoRA, embedding LoRA, a missing folder: each a ConfigError that names it.
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((Path(adapters["all"].lora_path) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ConfigError, match="DoRA is not supported"):
        llm.engine.add_lora(LoRARequest("dora", 9, str(dora)))
    with pytest.raises(ConfigError, match=r"no adapter_config\.json"):
        llm.engine.add_lora(LoRARequest("missing", 10, str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="enable_lora"):
        LLM(str(base_dir), device="cpu", num_kv_blocks=16, profile=None).generate(
            [PROMPTS[0]], SamplingParams(max_tokens=1), lora_request=adapters["all"]
        )


def test_embedding_lora_is_refused(base_dir, tmp_path):
    path = _build_adapter(
        base_dir, tmp_path / "embed", dict(r=2, target_modules=["embed_tokens", "q_proj"]), 5
    )
    llm = _llm(base_dir)
    with pytest.raises(ConfigError, match="embedding LoRA"):
        llm.engine.add_lora(LoRARequest("embed", 1, str(path)))


def test_lora_modules_forms():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}', {"c": "/z"}]) == (
        ("a", "/x"),
        ("b", "/y"),
        ("c", "/z"),
    )
    with pytest.raises(ConfigError, match="names 'a' twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ConfigError, match="expected name=path"):
        parse_lora_modules(["nope"])
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig.create("m", enable_lora=True, tensor_parallel_size=2)


def test_async_engine_loads_and_unloads_on_its_thread(base_dir, adapters, reference):
    """The in-process server engine: a runtime load, a request under it (equal to PEFT's), an
    unload; the commands run on the engine thread between steps."""
    from qiao.engine.async_engine import AsyncEngine, GenerateRequest
    from qiao.engine.llm_engine import LLMEngine

    config = EngineConfig.create(
        str(base_dir),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    engine = AsyncEngine.build(lambda: LLMEngine(config))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run() -> list[int]:
        engine.start()
        try:
            await engine.load_lora("all", adapters["all"].lora_path)
            assert engine.lora_adapters() == {"all": adapters["all"].lora_path}
            request = GenerateRequest("r0", PROMPTS[1], params, lora_name="all")
            tokens: list[int] = []
            async for output in engine.generate_all([request])[0]:
                tokens += output.outputs[0].token_ids
            await engine.unload_lora("all")
            with pytest.raises(ModelNotFoundError):
                await engine.unload_lora("all")
            return tokens
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == reference("all", PROMPTS[1])[0]
    assert engine.lora_adapters() == {}
