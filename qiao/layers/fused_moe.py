"""A mixture-of-experts layer: routing, the experts' stacked weights and the grouped dispatch.

Routing (`select_experts`) is transformers' Qwen2-MoE / Qwen3-MoE router step for step: softmax
over every expert in float32, top-k of those probabilities, optionally renormalised to sum to 1
(`norm_topk_prob`), then cast to the activations' dtype.

Dispatch (`fused_moe`): the flat (token, k) assignments are sorted by expert, so each expert's
tokens form one contiguous segment of a gathered copy of the rows; each non-empty expert runs
its gate_up and down matmuls on its segment (a loop over experts, never over tokens), the
outputs are scaled by their routing weights and summed back per token with `index_add_`. A
token's contributions are added in increasing expert order, as transformers adds them.
`fused_moe_reference` (every expert on every token, weighted by a dense [T, E] routing matrix)
is its test oracle.

The dispatch reads the experts' token counts on the host (one sync per layer), which a CUDA graph
cannot capture; while a graph is captured (pure-decode steps, qiao/runner/cuda_graphs.py) the
layer runs `fused_moe_dense` instead: every expert on every row, weighted by a dense routing
matrix, with no host sync. A decode step of a few dozen tokens reads most experts' weights
either way; it costs E / k times the matmul work, where decode is bound by the weight reads.

Weights: gate_up [E, 2 I, H] (gate rows, then up rows) and down [E, H, I], the layout
transformers 5 keeps in memory. They load from the per-expert checkpoint tensors
(`experts.{e}.gate_proj.weight`, `.up_proj.`, `.down_proj.`, what the hub's checkpoints and
transformers 5.25's `save_pretrained` write) or from the stacked ones (`experts.gate_up_proj`,
`experts.down_proj`). Tensor parallelism shards every expert's intermediate dim as the dense MLP
does (gate and up by rows, down by columns, as column- and row-parallel layers): each rank runs
every expert on its slice and the partial sums are all-reduced once, as a row-parallel layer's.
The router is replicated: every rank routes the same tokens to the same experts.

Once loaded (`prepare_experts`), each expert's two matrices become linear layers over views of
the stacks, with the `LinearMethod` a dense layer of that shape gets (qiao/layers/linear_method.py):
on an AVX-512 CPU in float32 the packed C++ kernel, oneDNN in bfloat16 (its row buckets), with
`quantization="int8"` weight-only int8 per expert and output channel (`Int8Method`), with
`batch_invariant` tiles of a fixed row count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qiao.distributed.parallel_state import all_reduce, divide, tp_rank
from qiao.errors import ConfigError, ModelLoadError
from qiao.layers.activation import SiluAndMul
from qiao.layers.linear import LinearBase, copy_checked
from qiao.layers.linear_method import DenseMethod, choose_method

# (rows [n, K], expert) -> [n, N]: one expert's matrix applied to its segment.
ExpertMatmul = Callable[[torch.Tensor, int], torch.Tensor]

QUANTIZATIONS = (None, "int8")


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] -> (routing weights [T, k] in the logits' dtype, expert ids [T, k]).

    The order transformers uses: softmax (float32) -> top-k -> renormalise -> cast.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_moe(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    gate_up: ExpertMatmul,
    down: ExpertMatmul,
) -> torch.Tensor:
    """hidden [T, H], routing [T, k] -> sum over k of weight * expert(hidden) [T, H].

    `gate_up(rows, e)` gives [n, 2 I] (gate | up), `down(rows, e)` [n, H].
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    # Assignment a = token * k + slot; sorted by expert, stable so tokens keep their order.
    # E.g. ids [[2, 0], [0, 1]] -> order [1, 2, 3, 0] -> token_of [0, 1, 1, 0], counts [2, 1, 1].
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # the one host sync
    rows = hidden[token_of]
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            out[start : start + count] = down(
                silu_and_mul(gate_up(rows[start : start + count], expert)), expert
            )
        start += count
    out.mul_(topk_weights.flatten()[order, None].to(out.dtype))
    return torch.zeros_like(hidden).index_add_(0, token_of, out)


silu_and_mul = SiluAndMul()  # one pass over each expert's [n, 2 I] (the C++ kernel on the CPU)


def fused_moe_dense(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """`fused_moe` without a host sync (CUDA graph capture): batched matmuls over every expert
    in the activations' dtype, [E, T, .] intermediates."""
    dense = torch.zeros(
        hidden.shape[0], w_gate_up.shape[0], dtype=hidden.dtype, device=hidden.device
    ).scatter_add_(1, topk_ids, topk_weights.to(hidden.dtype))
    gate, up = torch.matmul(hidden, w_gate_up.transpose(1, 2)).chunk(2, dim=-1)
    expert_out = torch.matmul(F.silu(gate) * up, w_down.transpose(1, 2))  # [E, T, H]
    return (expert_out * dense.T[..., None]).sum(dim=0)


def fused_moe_reference(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The dense oracle: every expert on every token, weighted by its routing weight there (0 for
    the experts a token did not choose). w_gate_up [E, 2 I, H], w_down [E, H, I]."""
    num_experts = w_gate_up.shape[0]
    dense = torch.zeros(hidden.shape[0], num_experts, dtype=torch.float32, device=hidden.device)
    dense.scatter_add_(1, topk_ids, topk_weights.float())
    gate, up = torch.einsum("th,eih->eti", hidden.float(), w_gate_up.float()).chunk(2, dim=-1)
    expert_out = torch.einsum("eti,ehi->eth", F.silu(gate) * up, w_down.float())
    return torch.einsum("eth,te->th", expert_out, dense).to(hidden.dtype)


class FusedMoE(nn.Module):
    """`num_experts` SiLU-gated MLPs of `intermediate_size` as two stacked weights, this rank's
    slice of every expert's intermediate dim."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = divide(intermediate_size, "moe_intermediate_size")
        rows = 2 * self.intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, rows, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.intermediate_size), requires_grad=False
        )
        # Per-expert linear layers, made by `prepare` once the weights are in; then the stacks
        # the layers' weights are views of, if they are (`prepare`).
        self.experts_gate_up: nn.ModuleList | None = None
        self.experts_down: nn.ModuleList | None = None
        self._views: dict[str, torch.Tensor] = {}

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """shard id None: a stacked tensor of every expert ([E, 2 I, H] or [E, H, I]); else
        (expert, part) with part 0 (gate) / 1 (up) of gate_up_proj, or None for down_proj."""
        if shard_id is None:
            if loaded_weight.shape[0] != self.num_experts:
                raise ModelLoadError(
                    f"stacked shape {tuple(loaded_weight.shape)}: {self.num_experts} experts "
                    "expected in dim 0"
                )
            for expert in range(self.num_experts):
                if param is self.gate_up_proj:
                    gate, up = loaded_weight[expert].chunk(2)
                    self._load_expert(param, gate, (expert, 0))
                    self._load_expert(param, up, (expert, 1))
                else:
                    self._load_expert(param, loaded_weight[expert], (expert, None))
            return
        self._load_expert(param, loaded_weight, shard_id)

    def _load_expert(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id) -> None:
        expert, part = shard_id
        size = self.intermediate_size
        if param is self.gate_up_proj:
            whole = loaded_weight.narrow(0, tp_rank() * size, size)
            copy_checked(param.data[expert].narrow(0, part * size, size), whole)
        else:
            copy_checked(param.data[expert], loaded_weight.narrow(1, tp_rank() * size, size))

    def prepare(
        self, quantization: str | None, batch_hint: int = 128, batch_invariant: bool = False
    ) -> None:
        """Once after loading: every expert's two matrices become linear layers with the method
        `choose_method` gives a dense layer of that shape (`experts_gate_up[e]`,
        `experts_down[e]`): packed for the CPU kernel, oneDNN, int8 or batch-invariant tiles.
        The stacked parameters go (their memory is counted once, through the experts' layers);
        where those layers compute on views of them, the stacks stay as plain tensors for the
        sync-free form (CUDA graph capture)."""
        if quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization: {quantization!r} is not supported for mixture-of-experts "
                f"weights; supported: {', '.join(str(q) for q in QUANTIZATIONS)}"
            )
        for name in _STACKED:
            linears = nn.ModuleList(_expert_linear(weight) for weight in getattr(self, name))
            for linear in linears:
                linear.method = choose_method(
                    linear.weight,
                    quantization=quantization,
                    batch_hint=batch_hint,
                    batch_invariant=batch_invariant,
                )
                linear.method.prepare(linear)
            setattr(self, f"experts_{name.removesuffix('_proj')}", linears)
            if all(type(linear.method) is DenseMethod for linear in linears):  # views kept
                self._views[name] = getattr(self, name).detach()
            delattr(self, name)
            self.register_parameter(name, None)

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H], routing [T, k] -> the experts' weighted sum [T, H], summed over ranks."""
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            return all_reduce(self._forward_dense(hidden, topk_weights, topk_ids))
        if self.experts_gate_up is None:  # not prepared (tests): F.linear on the stacks
            gate_up = lambda rows, e: F.linear(rows, self.gate_up_proj[e])  # noqa: E731
            down = lambda rows, e: F.linear(rows, self.down_proj[e])  # noqa: E731
        else:
            gate_up = lambda rows, e: self.experts_gate_up[e](rows)  # noqa: E731
            down = lambda rows, e: self.experts_down[e](rows)  # noqa: E731
        moe = fused_moe(hidden, topk_weights, topk_ids, self.num_experts, gate_up, down)
        return all_reduce(moe)

    def _forward_dense(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.experts_gate_up is None:
            stacks = [self.gate_up_proj, self.down_proj]
        elif len(self._views) == len(_STACKED):
            stacks = [self._views[name] for name in _STACKED]
        else:
            raise ConfigError(
                "mixture-of-experts weights converted for their linear method (int8) cannot run "
                "in a CUDA graph; set cuda_graphs to false"
            )
        return fused_moe_dense(hidden, topk_weights, topk_ids, *stacks)


_STACKED = ("gate_up_proj", "down_proj")


class RouterLinear(nn.Module):
    """y = x W^T for a router or an expert gate: replicated on every rank and never quantized
    (its outputs pick experts; int8 rounding there would change which). Not a `LinearBase`, so
    `prepare_linears` passes it by; `prepare_experts` gives it a dense layer's unquantized
    method, batch-invariant tiles included (it has a linear layer's attributes)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.register_parameter("bias", None)
        self.method = DenseMethod()

    def prepare(self, batch_hint: int, batch_invariant: bool) -> None:
        self.method = choose_method(
            self.weight, quantization=None, batch_hint=batch_hint, batch_invariant=batch_invariant
        )
        self.method.prepare(self)  # type: ignore[arg-type] (a linear layer by its attributes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)  # type: ignore[arg-type]


def _expert_linear(weight: torch.Tensor) -> LinearBase:
    """A linear layer over one expert's [N, K] slice of a stacked weight (a view, no copy)."""
    with torch.device("meta"):
        linear = LinearBase(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def prepare_experts(
    model: nn.Module, *, quantization: str | None, batch_hint: int, batch_invariant: bool = False
) -> None:
    """`FusedMoE.prepare` on every expert layer of a loaded model (the loader calls it after
    `prepare_linears`)."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.prepare(quantization, batch_hint, batch_invariant)
        elif isinstance(module, RouterLinear):
            module.prepare(batch_hint, batch_invariant)


def expert_shard(part_name: str) -> tuple[str, int | None]:
    """Per-expert checkpoint module -> (stacked parameter, part): gate_proj -> ("gate_up_proj",
    0), up_proj -> ("gate_up_proj", 1), down_proj -> ("down_proj", None)."""
    return _EXPERT_PARTS[part_name]


_EXPERT_PARTS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
EXPERT_PARTS = tuple(_EXPERT_PARTS)
