"""Offline inference, shaped like vLLM's `LLM` so existing scripts switch by changing the import."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from qiao.config import EngineConfig
from qiao.engine.llm_engine import LLMEngine, PromptType
from qiao.entrypoints.tuning import apply_num_threads, tuned_defaults
from qiao.errors import ConfigError
from qiao.lora.request import LoRARequest
from qiao.outputs import RequestOutput
from qiao.profile import ProfileChoice
from qiao.sampling_params import SamplingParams
from qiao.settings_schema import check_engine_kwargs

Message = dict[str, Any]
# Engine arguments a tuning profile may supply; passing None for one means "the default".
_TUNED_DEFAULTS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks")


class LLM:
    """An engine for offline batches: `LLM(model=PATH).generate(prompts, params)`.

    Keyword arguments mirror vLLM's where they mean the same thing; an unknown one is an error
    that names it, rather than being silently ignored.
    """

    def __init__(
        self,
        model: str,
        *,
        trust_remote_code: bool = False,
        num_threads: int | None = None,
        profile: ProfileChoice = "auto",
        **engine_kwargs: Any,
    ) -> None:
        """`engine_kwargs` are `EngineConfig.create`'s: tokenizer, dtype, load_format,
        max_model_len, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
        enable_prefix_caching, block_size, kv_cache_memory, num_kv_blocks, kv_cache_dtype,
        prefix_cache_reserve, scheduling_policy, seed, device, skip_tokenizer_init, quantization,
        batch_invariant.

        `num_threads` sets torch's thread count (process-wide). `profile`: "auto" takes
        `num_threads`, `max_num_seqs`, `max_num_batched_tokens` and `num_kv_blocks` defaults
        from the `qiao tune` profile of this model on this machine, if there is one; a path
        takes them from that file; None uses no profile. Arguments given here always win.
        """
        if trust_remote_code:
            raise ConfigError("trust_remote_code: qiao never runs code shipped with a checkpoint")
        accepted = inspect.signature(EngineConfig.create).parameters
        unknown = sorted(set(engine_kwargs) - set(accepted))
        if unknown:
            raise ConfigError(f"LLM() got unknown argument(s): {', '.join(unknown)}")
        # The CLI's checks of the same settings (qiao/settings_schema.py), with the same words.
        check_engine_kwargs({**engine_kwargs, "num_threads": num_threads})
        given = {**engine_kwargs, "num_threads": num_threads}
        given.update(tuned_defaults(model, given, profile))
        apply_num_threads(given.pop("num_threads"))
        # A tuned setting left None means the engine's default (so CLIs can pass flags through).
        kwargs = {k: v for k, v in given.items() if v is not None or k not in _TUNED_DEFAULTS}
        config = EngineConfig.create(model, **kwargs)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType | dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or a dict with `prompt` or `prompt_token_ids`.
        `sampling_params` is one object for all prompts or one per prompt; `lora_request` (an
        engine with `enable_lora`) likewise, None being the base model.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(
            sampling_params or SamplingParams(), len(prompt_list), "sampling_params"
        )
        priorities = _broadcast(
            list(priority) if priority is not None else 0, len(prompt_list), "priority"
        )
        loras = _broadcast(lora_request, len(prompt_list), "lora_request")
        request_ids = self._add_all(prompt_list, params_list, priorities, loras)
        return self._run(request_ids, params_list, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ConfigError("chat needs a tokenizer; this engine was built without one")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
            # The template writes special tokens (BOS) itself; don't add them twice.
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add_all(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priorities: list[int],
        loras: list[LoRARequest | None] | None = None,
    ) -> list[str]:
        request_ids: list[str] = []
        loras = loras or [None] * len(prompts)
        try:
            for prompt, p, prio, lora in zip(prompts, params, priorities, loras, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p, priority=prio, lora_request=lora)
                request_ids.append(request_id)
        except Exception:
            # All prompts are validated before any step runs: a bad one cancels the batch.
            self.engine.abort_request(request_ids)
            raise
        return request_ids

    def _run(
        self, request_ids: list[str], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        total_tokens = sum(p.n for p in params)
        with tqdm(
            total=len(request_ids),
            desc="Generating",
            unit="req",
            disable=not use_tqdm or total_tokens < 2,
        ) as bar:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    if isinstance(prompts, dict):
        prompts = [prompts]
    result: list[PromptType] = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ConfigError("prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        result.append(prompt)
    if not result:
        raise ConfigError("prompts must contain at least one prompt")
    return result


def _broadcast(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
