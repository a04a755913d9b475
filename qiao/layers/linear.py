"""Linear layers and how checkpoint tensors load into them.

Tensor parallelism (qiao/distributed/parallel_state.py): column-parallel layers keep this rank's
slice of the output features, row-parallel ones its slice of the input features and all-reduce
their outputs. With one rank every slice is the whole matrix and the all-reduce is the identity.

Loading convention: `module.weight_loader(param, loaded_weight, shard_id)` copies one whole
checkpoint tensor's slice for this rank into `param`; fused layers place it by `shard_id`, and
given shard id None take a checkpoint tensor of all their parts stacked (Phi-3's `qkv_proj`,
`gate_up_proj`), loaded part by part so each rank keeps its slice of each. Once every tensor is in,
`prepare_linears` gives each layer its `LinearMethod` (qiao/layers/linear_method.py), which may
replace the weight with a packed or int8 copy.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import nn

from qiao.distributed.parallel_state import all_reduce, divide, tp_rank, tp_size
from qiao.errors import ModelLoadError
from qiao.layers.linear_method import DenseMethod, LinearMethod, choose_method

if TYPE_CHECKING:
    from qiao.lora.slots import LoRASlots

logger = logging.getLogger(__name__)


def default_weight_loader(
    param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None = None
) -> None:
    """Copy a whole tensor; the target of every parameter outside a fused layer."""
    if shard_id is not None:
        raise ModelLoadError(f"parameter of shape {tuple(param.shape)} is not fused")
    copy_checked(param.data, loaded_weight)


def copy_checked(target: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if target.shape != loaded_weight.shape:
        raise ModelLoadError(
            f"shape {tuple(loaded_weight.shape)} in the checkpoint, {tuple(target.shape)} expected"
        )
    target.copy_(loaded_weight)


class LinearBase(nn.Module):
    """y = x W^T (+ b), with W of [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.method: LinearMethod = DenseMethod()
        # This layer's LoRA adapter slots, when the engine serves adapters (qiao/lora).
        self.lora: LoRASlots | None = None

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.lora is None else self.lora.apply(x, y)


def rank_slice(loaded_weight: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """This rank's `size` rows (dim 0) or columns (dim 1) of a whole checkpoint tensor."""
    return loaded_weight.narrow(dim, tp_rank() * size, size)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: this rank computes `output_size / tp` of them."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__(input_size, divide(output_size, "a layer's output features"), bias)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is not None:
            raise ModelLoadError(f"parameter of shape {tuple(param.shape)} is not fused")
        copy_checked(param.data, rank_slice(loaded_weight, 0, param.shape[0]))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed over the group. The
    bias is added once (rank 0 holds it, the others zeros)."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__(divide(input_size, "a layer's input features"), output_size, bias)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is not None:
            raise ModelLoadError(f"parameter of shape {tuple(param.shape)} is not fused")
        if param.dim() == 1:  # the bias
            copy_checked(param.data, loaded_weight if tp_rank() == 0 else loaded_weight * 0)
        else:
            copy_checked(param.data, rank_slice(loaded_weight, 1, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return all_reduce(y if self.lora is None else self.lora.apply(x, y))


def load_stacked(
    layer: LinearBase, param: torch.Tensor, loaded_weight: torch.Tensor, parts: list[tuple]
) -> None:
    """Load a checkpoint tensor that stacks a fused layer's parts along dim 0, `parts` being
    (shard id, rows of this rank) of each in order: every part is a whole tensor of
    rows * tp_size rows, loaded by its shard id.

    E.g. Phi-3's qkv_proj [(H + 2 Hkv) D, hidden] -> q [H D], k [Hkv D], v [Hkv D].
    """
    sizes = [rows * tp_size() for _, rows in parts]
    if loaded_weight.shape[0] != sum(sizes):
        raise ModelLoadError(
            f"stacked shape {tuple(loaded_weight.shape)} in the checkpoint, {sum(sizes)} rows "
            f"expected ({' + '.join(map(str, sizes))})"
        )
    for (shard_id, _), part in zip(parts, loaded_weight.split(sizes), strict=True):
        layer.weight_loader(param, part, shard_id)


class MergedLinear(ColumnParallelLinear):
    """Several projections of one input stacked along the output: shard i is `output_sizes[i]`
    (this rank's slice of each, stacked).

    E.g. gate_up_proj with output_sizes [I, I]: gate_proj loads as shard 0, up_proj as shard 1.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        self.output_sizes = [divide(n, "a merged layer's part") for n in output_sizes]
        LinearBase.__init__(self, input_size, sum(self.output_sizes), bias)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is None:
            parts = list(enumerate(self.output_sizes))
            return load_stacked(self, param, loaded_weight, parts)
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ModelLoadError(f"shard id {shard_id!r} of a {len(self.output_sizes)}-way merge")
        offset, size = sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]
        copy_checked(param.data.narrow(0, offset, size), rank_slice(loaded_weight, 0, size))


class QKVLinear(ColumnParallelLinear):
    """q, k and v projections stacked along the output: rows [q (H*D) | k (Hkv*D) | v (Hkv*D)]
    of this rank's heads (H / tp query heads, Hkv / tp key-value heads)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        q_size = divide(num_heads, "num_attention_heads") * head_dim
        kv_size = divide(num_kv_heads, "num_key_value_heads") * head_dim
        LinearBase.__init__(self, hidden_size, q_size + 2 * kv_size, bias)
        # shard id -> (first row, number of rows)
        self.shards = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        self.split_sizes = [q_size, kv_size, kv_size]

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is None:
            parts = [(shard, rows) for shard, (_, rows) in self.shards.items()]
            return load_stacked(self, param, loaded_weight, parts)
        if shard_id not in self.shards:
            raise ModelLoadError(f"shard id {shard_id!r} of qkv; expected 'q', 'k' or 'v'")
        offset, size = self.shards[shard_id]
        copy_checked(param.data.narrow(0, offset, size), rank_slice(loaded_weight, 0, size))


def prepare_linears(
    model: nn.Module, *, quantization: str | None, batch_hint: int, batch_invariant: bool = False
) -> None:
    """Give every linear layer of a loaded model its method, converting its weight once;
    batch-invariant ones with `batch_invariant` (see linear_method)."""
    used: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.method = choose_method(
                module.weight,
                quantization=quantization,
                batch_hint=batch_hint,
                batch_invariant=batch_invariant,
            )
            module.method.prepare(module)
            used[module.method.name] += 1
    if used:
        logger.info(
            "linear layers: %s", ", ".join(f"{n} x {name}" for name, n in sorted(used.items()))
        )
