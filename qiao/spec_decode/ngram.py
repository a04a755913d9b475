"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
request's last n tokens, for n from `prompt_lookup_max` down to `prompt_lookup_min`.

Text that copies spans of its prompt (editing, extraction, code rewrites) repeats long runs, so
the tokens after an earlier copy of the current suffix are often the next ones. The lookup costs
one vectorised compare of the history with the last token and one of the candidate windows found
with the suffix; no model runs. `find_ngram_continuation_reference` (every window compared, n by
n) is the test oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from qiao.engine.request import Request


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        # Request id -> (buffer, filled): its tokens as int64, extended in place as it grows
        # (tokens are only ever appended), so a step copies only the new ones.
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose_batch(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        """Draft tokens for each request, at most min(k, room) each. The token buffers of
        requests not in `requests` are dropped."""
        wanted = {r.request_id for r in requests}
        for request_id in [rid for rid in self._tokens if rid not in wanted]:
            del self._tokens[request_id]
        return [
            self.propose(self._token_array(r), room)
            for r, room in zip(requests, rooms, strict=True)
        ]

    def _token_array(self, request: Request) -> np.ndarray:
        buffer, filled = self._tokens.get(request.request_id, (np.empty(0, np.int64), 0))
        length = request.num_tokens
        if len(buffer) < length:  # doubling, so the copies stay linear in the length
            grown = np.empty(max(2 * len(buffer), length, 64), np.int64)
            grown[:filled] = buffer[:filled]
            buffer = grown
        buffer[filled:length] = request.all_token_ids[filled:length]
        self._tokens[request.request_id] = (buffer, length)
        return buffer[:length]

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to `num_speculative_tokens` (and `max_tokens`) tokens to verify after `token_ids`
        (the request's prompt + output, int64); [] when no suffix of n >= min_n recurs."""
        k = (
            self.num_speculative_tokens
            if max_tokens is None
            else min(self.num_speculative_tokens, max_tokens)
        )
        if k <= 0:
            return []
        return find_ngram_continuation(token_ids, self.min_n, self.max_n, k).tolist()


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The (at most k) tokens after the latest earlier window equal to the last n tokens, for
    the largest n in [min_n, max_n] that has one; empty when none does.

    E.g. tokens [1, 2, 3, 4, 1, 2], n = 2, k = 3 -> the window [1, 2] at 0 -> [3, 4, 1].
    """
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return tokens[:0]
    # Candidate window ends: earlier positions holding the last token, each followed by one.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    ends = ends[ends >= min_n - 1]
    if not len(ends):
        return tokens[:0]
    # matched[c, j]: the token j before end c equals the token j before the last one; a run of
    # leading matches is that window's match length. E.g. tokens [1, 2, 3, 4, 1, 2], end 1:
    # [2 == 2, 1 == 1] -> length 2.
    back = ends[:, None] - np.arange(max_n)
    matched = (tokens[np.maximum(back, 0)] == tokens[length - 1 - np.arange(max_n)]) & (back >= 0)
    run = matched.cumprod(axis=1).sum(axis=1)
    best = run.max()
    if best < min_n:
        return tokens[:0]
    end = ends[np.flatnonzero(run == best)[-1]]  # the latest of the longest
    return tokens[end + 1 : end + 1 + k]


def find_ngram_continuation_reference(
    tokens: np.ndarray, min_n: int, max_n: int, k: int
) -> np.ndarray:
    """The same answer, every window of each length n compared with the suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(starts):
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return tokens[:0]
