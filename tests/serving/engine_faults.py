"""Faults injected into an engine process through QIAO_ENGINE_HOOK=module:function (qiao/envs.py):
each function gets the built `LLMEngine` and wraps its runner."""

from __future__ import annotations

import time
from typing import Any

# A token-id prompt whose first token is MARK hangs its step; one starting with RAISE makes every
# step it is in raise.
MARK = 400
RAISE = 401


def _marked(scheduler_output: Any) -> bool:
    return any(
        s.num_computed_tokens == 0 and s.token_ids[:1] == [MARK] for s in scheduler_output.scheduled
    )


def hang_on_mark(engine: Any) -> None:
    """The step that prefills a marked prompt never returns."""
    execute = engine.runner.execute

    def hanging(scheduler_output: Any) -> Any:
        if _marked(scheduler_output):
            time.sleep(3600)
        return execute(scheduler_output)

    engine.runner.execute = hanging


def faults(engine: Any) -> None:
    """MARK hangs the step that prefills it; RAISE makes each step it is in raise."""
    execute = engine.runner.execute

    def faulty(scheduler_output: Any) -> Any:
        if _marked(scheduler_output):
            time.sleep(3600)
        if any(s.request.prompt_token_ids[0] == RAISE for s in scheduler_output.scheduled):
            raise RuntimeError("injected fault")
        return execute(scheduler_output)

    engine.runner.execute = faulty


# Encoder processes (QIAO_ENCODER_HOOK): each function gets the loaded `Encoder` and wraps its
# `embed`. The marks are ids of the tests' tiny BERT vocabulary ([UNK], [MASK]) that no text
# starts with (a text's first token is [CLS]).
ENCODER_SLOW = 1
ENCODER_HANG = 4
SLOW_BATCH_S = 3.0


def encoder_faults(encoder: Any) -> None:
    """A batch with a row starting with ENCODER_HANG never returns; one with a row starting with
    ENCODER_SLOW takes SLOW_BATCH_S longer."""
    embed = encoder.embed

    def faulty(token_ids: Any) -> Any:
        firsts = {row[0] for row in token_ids}
        if ENCODER_HANG in firsts:
            time.sleep(3600)
        if ENCODER_SLOW in firsts:
            time.sleep(SLOW_BATCH_S)
        return embed(token_ids)

    encoder.embed = faulty
