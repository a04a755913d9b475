"""Token embedding and LM head.

Named for tensor parallelism (split along the vocabulary); qiao runs one rank, so each holds
the whole vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qiao.layers.linear import LinearBase


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(LinearBase):
    """hidden [N, hidden_size] -> logits [N, vocab_size] in float32.

    With tied embeddings the head is given the embedding's weight; a method that converts it
    (packed, int8) keeps a converted copy and leaves the embedding's own tensor alone.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden).float()
