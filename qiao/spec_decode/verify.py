"""A verifying step's sampling: one sampling row per position, and the accepted run of drafts.

A request with k draft tokens d_1..d_k computes 1 + k positions; position j's logits predict the
token after d_j (after the last sampled token for j = 0). Each position becomes one sampler row
whose sampling state is the request's with d_1..d_j appended to its output: penalties,
`min_tokens` and the seeded uniform (a function of the generation index) are then exactly those
plain decoding would use at that token. The target's tokens t_0..t_k sampled there are kept up to
and including the first t_j that differs from d_{j+1} (all of them when every draft matches): each
kept token is the one plain decoding would have produced.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from qiao.runner.sampler import SamplerOutput, SamplingRow


def logit_rows(last_token: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Flat-batch rows whose logits a step samples: each sequence's last 1 + k tokens.

    E.g. last tokens [4, 9], drafts [2, 0] -> rows [2, 3, 4, 9].
    """
    counts = num_drafts + 1
    # E.g. counts [3, 1] -> first row of each group [0, 3]; offset in group [0, 1, 2, 0]
    group_start = np.cumsum(counts) - counts
    offset = np.arange(int(counts.sum())) - np.repeat(group_start, counts)
    return np.repeat(last_token - num_drafts, counts) + offset


def expand_sampling_rows(
    rows: Sequence[SamplingRow], draft_token_ids: Sequence[Sequence[int]]
) -> list[SamplingRow]:
    """Row i becomes 1 + len(drafts[i]) rows, the j-th with drafts[i][:j] generated already."""
    expanded = []
    for row, drafts in zip(rows, draft_token_ids, strict=True):
        expanded.append(row)
        for j in range(1, len(drafts) + 1):
            output = [*row.output_token_ids, *drafts[:j]]
            expanded.append(dataclasses.replace(row, output_token_ids=output))
    return expanded


def group_starts(num_drafts: np.ndarray) -> np.ndarray:
    """Index of each request's first sampled row. E.g. drafts [2, 0, 1] -> [0, 3, 4]."""
    counts = num_drafts + 1
    return np.cumsum(counts) - counts


def accept_drafts(
    sampled: torch.Tensor, num_drafts: np.ndarray, draft_token_ids: Sequence[Sequence[int]]
) -> tuple[list[int], list[list[int]]]:
    """(each request's first token, the tokens after it this step keeps) from the target's
    tokens `sampled` [sum(1 + k_i)], grouped per request as `logit_rows` lays them out.

    E.g. drafts [[7, 8, 9]], sampled [7, 8, 5, 2] -> 7 and 8 accepted, then the target's 5:
    first token 7, then [8, 5].
    """
    num_requests = len(num_drafts)
    max_k = int(num_drafts.max(initial=0))
    device = sampled.device
    starts = torch.from_numpy(group_starts(num_drafts)).to(device)
    k = torch.from_numpy(num_drafts).to(device)
    column = torch.arange(max_k + 1, device=device)
    index = (starts[:, None] + column).clamp(max=len(sampled) - 1)
    target = sampled[index]  # [N, K + 1]; columns past a request's k are padding
    # E.g. drafts [[7, 8], [], [5]] -> [[7, 8], [-1, -1], [5, -1]] (row-major fill of the mask)
    drafts = np.full((num_requests, max_k), -1, dtype=np.int64)
    drafts[np.arange(max_k) < num_drafts[:, None]] = np.fromiter(
        itertools.chain.from_iterable(draft_token_ids), np.int64, int(num_drafts.sum())
    )
    is_draft = column[:max_k] < k[:, None]
    matched = (target[:, :max_k] == torch.from_numpy(drafts).to(device)) & is_draft
    # E.g. matches [1, 1, 0, 1] -> cumprod [1, 1, 0, 0] -> 2 accepted
    num_accepted = matched.long().cumprod(dim=1).sum(dim=1)
    table = torch.cat([num_accepted[:, None], target], dim=1).tolist()
    firsts = [row[1] for row in table]
    runs = [row[2 : 2 + row[0]] for row in table]
    return firsts, runs


def first_rows(sampled: SamplerOutput, rows: torch.Tensor) -> SamplerOutput:
    """The sampler's output at each request's first row (its logprobs, when asked)."""

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]

    return dataclasses.replace(
        sampled,
        sampled_token_ids=sampled.sampled_token_ids[rows],
        logprob_token_ids=pick(sampled.logprob_token_ids),
        logprobs=pick(sampled.logprobs),
        sampled_ranks=pick(sampled.sampled_ranks),
    )
