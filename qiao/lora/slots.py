"""A linear layer's adapters on the device, and the grouped computation of their outputs.

Every LoRA-enabled layer holds stacked A [slots, R, K] and B [slots, N, R] (float in the model's
dtype), slot 0 being "no adapter" (zeros). A fused layer keeps its parts' ranks side by side: an
adapter of rank r on q and v of `qkv_proj` fills A's rows [0, r) with A_q and [r, 2r) with A_v,
and B's q rows of columns [0, r) and v rows of columns [r, 2r) (block diagonal), so one matmul
pair computes every part; R = parts * max_lora_rank, zero-padded.

One step's plan (`LoRAStepPlan`, built once per step by the runner's `LoRAManager`) sorts the
tokens that have an adapter by slot; each layer then multiplies one contiguous slice per active
adapter (like an MoE dispatch), never a loop over requests or tokens, and adds the results back
in place with one `index_add_`. A step without adapters skips all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAStepPlan:
    """Which tokens of a step run under which slot."""

    # [T] int64 on the device: each token's slot (0: none). The reference's input.
    token_slots: torch.Tensor
    # [Ta] int64 on the device: the tokens with an adapter, sorted by slot.
    rows: torch.Tensor
    # (slot, start, end) of each active slot's slice of `rows`.
    segments: list[tuple[int, int, int]]
    # When `rows` is one run of consecutive tokens (the step's sequences under adapters sit
    # together, grouped by adapter: e.g. every sequence under one adapter), its first token:
    # the layers then work on slices of x and y, without a gather or a scatter. Else None.
    offset: int | None = None


def build_plan(
    request_slots: np.ndarray, query_lens: np.ndarray, device: torch.device
) -> LoRAStepPlan | None:
    """The plan of a step whose sequence i runs `query_lens[i]` tokens under `request_slots[i]`;
    None when no token has an adapter."""
    if not request_slots.any():
        return None
    # E.g. slots [2, 0, 1], lens [2, 1, 3] -> token slots [2, 2, 0, 1, 1, 1]
    token_slots = np.repeat(request_slots, query_lens)
    # -> order [2, 3, 4, 5, 0, 1] (stable), sorted slots [0, 1, 1, 1, 2, 2]; slot 0 comes first.
    order = np.argsort(token_slots, kind="stable")
    sorted_slots = token_slots[order]
    first = int(np.searchsorted(sorted_slots, 1))
    # -> rows [3, 4, 5, 0, 1], segments [(1, 0, 3), (2, 3, 5)]
    slots, starts, counts = np.unique(sorted_slots[first:], return_index=True, return_counts=True)
    segments = [(int(s), int(a), int(a + c)) for s, a, c in zip(slots, starts, counts, strict=True)]
    rows = order[first:]
    consecutive = bool((np.diff(rows) == 1).all())
    return LoRAStepPlan(
        token_slots=torch.from_numpy(token_slots).to(device),
        rows=torch.from_numpy(rows).to(device),
        segments=segments,
        offset=int(rows[0]) if consecutive else None,
    )


class LoRAContext:
    """The step plan every LoRA-enabled layer of one model reads (None outside a LoRA step)."""

    def __init__(self) -> None:
        self.plan: LoRAStepPlan | None = None


class LoRASlots:
    """One linear layer's adapter slots. `part_sizes`: rows of each fused part of the output
    (one part for an unfused layer)."""

    def __init__(
        self,
        context: LoRAContext,
        *,
        input_size: int,
        part_sizes: list[int],
        num_slots: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.context = context
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.max_lora_rank = max_lora_rank
        width = len(part_sizes) * max_lora_rank
        self.lora_a = torch.zeros(num_slots, width, input_size, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, sum(part_sizes), width, dtype=dtype, device=device)
        # Columns of A / B in use per slot (the adapter's parts' ranks summed); host ints.
        self.ranks = [0] * num_slots

    def set_slot(
        self, slot: int, parts: dict[int | None, tuple[torch.Tensor, torch.Tensor]] | None
    ) -> None:
        """Write an adapter's weights of this layer (part -> (A, B)) into `slot`; None clears it."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        column = 0
        for part, (a, b) in sorted((parts or {}).items(), key=lambda kv: kv[0] or 0):
            rank = a.shape[0]
            if part is None:
                offset, size = 0, self.lora_b.shape[1]
            else:
                offset, size = self.part_offsets[part], self.part_sizes[part]
            if a.shape[1] != self.lora_a.shape[2] or b.shape[0] != size:
                raise ValueError(
                    f"A {tuple(a.shape)} / B {tuple(b.shape)} for a part of {size} rows and "
                    f"{self.lora_a.shape[2]} inputs"
                )
            self.lora_a[slot, column : column + rank] = a
            self.lora_b[slot, offset : offset + size, column : column + rank] = b
            column += rank
        self.ranks[slot] = column

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + this step's LoRA outputs for x [T, K], y [T, N] (in place); y itself without a
        plan or when no active adapter adapts this layer."""
        plan = self.context.plan
        if plan is None:
            return y
        segments = [(s, a, b) for s, a, b in plan.segments if self.ranks[s]]
        if not segments:
            return y
        if plan.offset is not None:
            for slot, start, end in segments:
                rank, rows = self.ranks[slot], slice(plan.offset + start, plan.offset + end)
                shrunk = x[rows] @ self.lora_a[slot, :rank].T
                y[rows].addmm_(shrunk, self.lora_b[slot, :, :rank].T)
            return y
        x_rows = x.index_select(0, plan.rows)
        out = torch.zeros(len(x_rows), y.shape[-1], dtype=y.dtype, device=y.device)
        for slot, start, end in segments:
            rank = self.ranks[slot]
            shrunk = x_rows[start:end] @ self.lora_a[slot, :rank].T
            torch.mm(shrunk, self.lora_b[slot, :, :rank].T, out=out[start:end])
        return y.index_add_(0, plan.rows, out)


def lora_reference(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """The plain LoRA output of x [T, K] (the grouped path's oracle): each token's own slot's
    A and B gathered, over the zero-padded full width."""
    shrunk = torch.einsum("tk,trk->tr", x, lora_a[token_slots])
    return torch.einsum("tr,tnr->tn", shrunk, lora_b[token_slots])
