"""Faults injected into an engine process through QIAO_ENGINE_HOOK=module:function (qiao/envs.py):
each function gets the built `LLMEngine` and wraps its runner."""

from __future__ import annotations

import time
from typing import Any

# A prompt whose first token is this id (a token-id prompt) sets the fault off.
MARK = 400


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
