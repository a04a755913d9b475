"""qiao's models against Hugging Face transformers, logits at every computed position.

A small paged runner drives the model the way the engine does: a flat batch of several
sequences, a block-shuffled KV cache (block_size 16, so blocks boundaries are crossed), prefill
chunks continuing from the cache, and decode tokens mixed with prefills in one step.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers
from conftest import ARCHS, build_attn_metadata

from qiao.errors import ConfigError
from qiao.layers.rotary import RotaryEmbedding
from qiao.models import load_arch_config, load_model
from qiao.models.arch_config import ArchConfig

BLOCK_SIZE = 16
ATOL = 1e-4


class PagedRunner:
    """Runs steps of {seq_id: num_new_tokens} over fixed token sequences, like the engine."""

    def __init__(self, model_dir: Path, sequences: dict[int, list[int]], num_blocks: int = 64):
        self.arch = load_arch_config(model_dir)
        self.model = load_model(
            model_dir, self.arch, dtype=torch.float32, device=torch.device("cpu")
        )
        self.sequences = sequences
        self.num_computed = dict.fromkeys(sequences, 0)
        self.block_tables: dict[int, list[int]] = {seq_id: [] for seq_id in sequences}
        self.free_blocks = list(range(num_blocks))
        random.Random(0).shuffle(self.free_blocks)
        shape = (2, num_blocks, BLOCK_SIZE, self.arch.num_key_value_heads, self.arch.head_dim)
        # NaN where nothing was written: a read of an unwritten slot would show.
        caches = [torch.full(shape, float("nan")) for _ in range(self.arch.num_hidden_layers)]
        self.model.bind_kv_caches(caches)

    @torch.inference_mode()
    def step(self, schedule: dict[int, int]) -> dict[int, torch.Tensor]:
        """Logits [n, vocab] of the n new tokens of each scheduled sequence."""
        input_ids, query_lens, seq_lens = [], [], []
        for seq_id, num_new in schedule.items():
            start = self.num_computed[seq_id]
            end = start + num_new
            assert end <= len(self.sequences[seq_id])
            while len(self.block_tables[seq_id]) * BLOCK_SIZE < end:
                self.block_tables[seq_id].append(self.free_blocks.pop())
            input_ids += self.sequences[seq_id][start:end]
            query_lens.append(num_new)
            seq_lens.append(end)
            self.num_computed[seq_id] = end
        tables = [self.block_tables[seq_id] for seq_id in schedule]
        metadata = build_attn_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        hidden = self.model(torch.tensor(input_ids), metadata.positions, metadata)
        logits = self.model.compute_logits(hidden).split(query_lens)
        return dict(zip(schedule, logits, strict=True))


def _sequences(lengths: list[int], seed: int = 0) -> dict[int, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        i: torch.randint(0, 320, (n,), generator=generator).tolist() for i, n in enumerate(lengths)
    }


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def hf_logits(arch_dir):
    """hf_logits(tokens) -> [len, vocab] logits of transformers on one whole sequence.

    LongRoPE (phi4mini): transformers picks short or long factors per forward, qiao per position
    (qiao/layers/rotary.py), so the sequence goes in as transformers' `generate` would see it:
    the positions below original_max_position_embeddings in one forward (short factors), the
    rest in a second one over its KV cache (long factors)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        arch_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    scaling = load_arch_config(arch_dir).rope_scaling or {}
    is_longrope = scaling.get("rope_type") == "longrope"
    split = scaling["original_max_position_embeddings"] if is_longrope else None

    @torch.inference_mode()
    def logits(tokens: list[int]) -> torch.Tensor:
        if split is None or len(tokens) <= split:
            return model(torch.tensor([tokens])).logits[0].float()
        first = model(torch.tensor([tokens[:split]]), use_cache=True)
        rest = model(torch.tensor([tokens[split:]]), past_key_values=first.past_key_values)
        return torch.cat((first.logits[0], rest.logits[0])).float()

    return logits


def _run_and_compare(arch_dir, hf_logits, lengths: list[int], steps: list[dict[int, int]]):
    sequences = _sequences(lengths)
    runner = PagedRunner(arch_dir, sequences)
    reference = {seq_id: hf_logits(tokens) for seq_id, tokens in sequences.items()}
    done = dict.fromkeys(sequences, 0)
    for step_index, schedule in enumerate(steps):
        for seq_id, logits in runner.step(schedule).items():
            expected = reference[seq_id][done[seq_id] : done[seq_id] + schedule[seq_id]]
            diff = (logits - expected).abs().max().item()
            assert diff <= ATOL, f"step {step_index} seq {seq_id}: max |diff| {diff:.2e}"
            done[seq_id] += schedule[seq_id]
    assert done == {seq_id: len(tokens) for seq_id, tokens in sequences.items()}


def test_prefill_mixed_lengths(arch_dir, hf_logits):
    lengths = [1, 7, 16, 17, 33, 70]
    _run_and_compare(arch_dir, hf_logits, lengths, [dict(enumerate(lengths))])


def test_chunked_prefill_reads_earlier_chunk_from_cache(arch_dir, hf_logits):
    lengths = [40, 70, 17, 2]
    first = {0: 16, 1: 23, 2: 1, 3: 1}
    rest = {seq_id: n - first[seq_id] for seq_id, n in enumerate(lengths)}
    _run_and_compare(arch_dir, hf_logits, lengths, [first, rest])


def test_decode_steps_mixed_with_prefill(arch_dir, hf_logits):
    lengths = [24, 40, 34, 25]
    steps = [
        {0: 20, 1: 35},
        {0: 1, 1: 1, 2: 30},
        {0: 1, 1: 1, 2: 1, 3: 10},
        {0: 1, 1: 1, 2: 1, 3: 15},
        {0: 1, 1: 1, 2: 1},
        {1: 1, 2: 1},
    ]
    _run_and_compare(arch_dir, hf_logits, lengths, steps)


def test_stories260k_first_logits(stories_dir):
    runner = PagedRunner(stories_dir, {0: [1, 403, 407, 261, 378]})
    last = runner.step({0: 5})[0][-1]
    top = torch.topk(last, 2)
    assert top.indices.tolist()[0] == 432
    assert abs(top.values[0].item() - 17.7994) <= 1e-3
    assert top.indices.tolist()[1] == 383
    assert abs(top.values[1].item() - 14.2813) <= 1e-3


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
def test_rotary_cos_sin_match_transformers_exactly(rope_type):
    scaling = ROPE_CASES[rope_type]
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling=dict(scaling) if scaling else None,
    )
    hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 63, 64, 511, 1000, 4095])
    hf_cos, hf_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    with torch.device("meta"):
        rotary = RotaryEmbedding(64, 500000.0, scaling)
    cos, sin = rotary(positions, torch.float32)
    assert torch.equal(cos, hf_cos[0])
    assert torch.equal(sin, hf_sin[0])


def test_unsupported_rope_type_names_the_field(tiny_checkpoint):
    arch = load_arch_config(tiny_checkpoint("llama"))
    fields = {name: getattr(arch, name) for name in arch.__dataclass_fields__}
    with pytest.raises(ConfigError, match=r"rope_scaling\.rope_type.*'yarn'"):
        ArchConfig(**{**fields, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
