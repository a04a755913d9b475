"""Rejection sampling of draft tokens against the target distribution (Leviathan et al. 2023;
Chen et al. 2023), vectorised over [requests, positions, vocabulary].

Draft token x_j (drawn from the draft's q_j) is accepted with probability min(1, p_j(x) / q_j(x));
at the first rejection the token is drawn from norm(max(0, p_j - q_j)) and the run ends; when
every draft is accepted a bonus token is drawn from p_k. Each emitted token is then distributed
exactly as p. A proposal without probabilities (the n-gram lookup's, a greedy draft) is q = one-hot:
accepted with probability p(x), replaced by a draw from p with x removed.

`rejection_sample_reference` is the same rule one request and one position at a time: the test
oracle. (The engine verifies one-hot proposals by comparing them with the target's own seeded
samples, `verify.accept_drafts`: the same distribution, and the tokens plain decoding draws.)
"""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    accept_uniforms: torch.Tensor,
    recover_uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, K + 1] padded with -1 after each run, accepted draft counts [N]).

    target_probs [N, K + 1, V]: p at each draft position and after the last one;
    draft_token_ids [N, K] (padding past num_drafts[i] is ignored); accept_uniforms [N, K] and
    recover_uniforms [N] in (0, 1); draft_probs [N, K, V] or None for one-hot proposals.
    """
    num_requests, width, _ = target_probs.shape
    max_k = width - 1
    column = torch.arange(max_k, device=target_probs.device)
    is_draft = column < num_drafts[:, None]
    x = draft_token_ids.clamp(min=0)
    p_x = target_probs[:, :max_k].gather(2, x[..., None]).squeeze(2)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
        residual = target_probs[:, :max_k].scatter(2, x[..., None], 0.0)
    else:
        q_x = draft_probs.gather(2, x[..., None]).squeeze(2)
        residual = (target_probs[:, :max_k] - draft_probs).clamp(min=0.0)
    # u < p / q, written without the division (q_x > 0 for a token the draft drew).
    accepted = (accept_uniforms * q_x < p_x) & is_draft
    # E.g. accepted [1, 1, 0, 1] -> cumprod [1, 1, 0, 0] -> 2
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    # The distribution the token after the accepted run comes from: the residual at a rejection,
    # p itself after every draft was accepted (the bonus token).
    last = torch.cat([residual, target_probs[:, max_k:]], dim=1)
    rows = torch.arange(num_requests, device=target_probs.device)
    bonus = num_accepted == num_drafts
    position = torch.where(bonus, max_k, num_accepted)
    dist = last[rows, position]
    dist = torch.where(bonus[:, None], target_probs[rows, num_drafts], dist)
    recovered = _inverse_cdf(dist, recover_uniforms)
    columns = torch.arange(width, device=target_probs.device)
    padded = torch.cat([x, x[:, :1]], dim=1)
    tokens = torch.where(columns < num_accepted[:, None], padded, -1)
    tokens = torch.where(columns == num_accepted[:, None], recovered[:, None], tokens)
    return tokens, num_accepted


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of unnormalised `probs` [N, V]: the first token whose cdf reaches u."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp(max=probs.shape[-1] - 1)


def rejection_sample_reference(
    target_probs: torch.Tensor,
    draft_token_ids: list[list[int]],
    accept_uniforms: torch.Tensor,
    recover_uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """The same rule, a request and a position at a time (the test oracle)."""
    out = []
    for i, drafts in enumerate(draft_token_ids):
        tokens: list[int] = []
        for j, x in enumerate(drafts):
            p = target_probs[i, j]
            q = torch.zeros_like(p)
            if draft_probs is None:
                q[x] = 1.0
            else:
                q = draft_probs[i, j]
            if float(accept_uniforms[i, j]) < float(p[x] / q[x]):
                tokens.append(x)
                continue
            tokens.append(
                int(_inverse_cdf((p - q).clamp(min=0)[None], recover_uniforms[i : i + 1]))
            )
            break
        else:
            p = target_probs[i, len(drafts)]
            tokens.append(int(_inverse_cdf(p[None], recover_uniforms[i : i + 1])))
        out.append(tokens)
    return out
