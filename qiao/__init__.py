"""qiao: an LLM inference engine and model-serving platform.

`from qiao import LLM, SamplingParams` works as in vLLM. Heavy modules (torch, transformers) load
on first use, so `import qiao` and `qiao --help` stay fast.
"""

from typing import TYPE_CHECKING, Any

from qiao.version import __version__

if TYPE_CHECKING:
    from qiao.entrypoints.llm import LLM
    from qiao.outputs import CompletionOutput, Logprob, RequestOutput
    from qiao.sampling_params import SamplingParams

_LAZY = {
    "LLM": "qiao.entrypoints.llm",
    "CompletionOutput": "qiao.outputs",
    "Logprob": "qiao.outputs",
    "RequestOutput": "qiao.outputs",
    "SamplingParams": "qiao.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qiao' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]
