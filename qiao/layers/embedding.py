"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks.

Each rank holds `ceil(vocab / tp)` rows (the last rank's tail is zero padding). The embedding
looks up the ids in its range and the ranks' rows are summed; the head computes its range's
logits and the ranks' logits are gathered. With one rank each holds the whole vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qiao.distributed.parallel_state import all_gather_last_dim, all_reduce, tp_rank, tp_size
from qiao.errors import ModelLoadError
from qiao.layers.linear import LinearBase


def vocab_rows_per_rank(vocab_size: int) -> int:
    return -(-vocab_size // tp_size())


def load_vocab_rows(param: torch.Tensor, loaded_weight: torch.Tensor, vocab_size: int) -> None:
    """This rank's vocabulary rows of a whole [vocab, hidden] tensor; padding rows zero."""
    if loaded_weight.shape != (vocab_size, param.shape[1]):
        raise ModelLoadError(
            f"shape {tuple(loaded_weight.shape)} in the checkpoint, "
            f"{(vocab_size, param.shape[1])} expected"
        )
    start = tp_rank() * param.shape[0]
    rows = max(0, min(param.shape[0], vocab_size - start))
    param.data.zero_()
    param.data[:rows].copy_(loaded_weight[start : start + rows])


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        rows = vocab_rows_per_rank(vocab_size)
        self.vocab_start = tp_rank() * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        load_vocab_rows(param, loaded_weight, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(LinearBase):
    """hidden [N, hidden_size] -> logits [N, vocab_size] in the weights' dtype.

    Not converted to float32 here: the sampler does that where it needs to (sampling,
    penalties, logprobs) and a greedy batch takes its argmax on the logits as they are. In
    bfloat16 the float32 copy was a new [N, vocab] buffer every step: on the Qwen2.5-0.5B shape
    (152K tokens) 39 MB for 64 rows, page-faulted in afresh each time. Tensor-parallel shards
    are gathered in float32.

    With tied embeddings the head is given the embedding's weight (the same rows on each rank);
    a method that converts it (packed, int8) keeps a converted copy and leaves the embedding's
    own tensor alone.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(hidden_size, vocab_rows_per_rank(vocab_size), bias=False)
        self.vocab_size = vocab_size

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        load_vocab_rows(param, loaded_weight, self.vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if tp_size() == 1:
            return logits
        return all_gather_last_dim(logits.float())[:, : self.vocab_size]
