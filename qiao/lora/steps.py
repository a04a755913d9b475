"""A step split by adapter: when a step holds more adapters than there are device slots, the
runner runs it in parts (each within the slots) and merges their outputs into one."""

from __future__ import annotations

import dataclasses

from qiao.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


def sub_step(items: list[ScheduledRequest]) -> SchedulerOutput:
    """A step of only `items` (the same requests' shares, nothing else)."""
    return SchedulerOutput(
        scheduled=list(items), num_scheduled_tokens=sum(len(s.token_ids) for s in items)
    )


def merge_outputs(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """The parts' outputs as one: per-row lists concatenated in part order (a part without an
    optional list contributes None rows), dicts merged."""
    merged = ModelRunnerOutput()
    for f in dataclasses.fields(ModelRunnerOutput):
        values = [getattr(out, f.name) for out in outputs]
        if any(isinstance(v, dict) for v in values):
            setattr(merged, f.name, {k: v for d in values if d for k, v in d.items()})
        elif all(v is None for v in values):
            setattr(merged, f.name, None)
        else:
            rows: list = []
            for out, value in zip(outputs, values, strict=True):
                rows += value if value is not None else [None] * len(out.req_ids)
            setattr(merged, f.name, rows)
    return merged
