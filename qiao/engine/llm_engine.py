"""The engine: requests in, outputs out, one `step()` at a time.

`LLM.generate()` (offline) and the server's async loop (online) both drive this same `step()`.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from qiao import envs
from qiao.config import EngineConfig, SchedulerConfig
from qiao.engine.adaptive import BudgetController
from qiao.engine.block_manager import BlockManager
from qiao.engine.output_processor import OutputProcessor
from qiao.engine.request import Request, RequestStatus
from qiao.engine.scheduler import Scheduler
from qiao.errors import (
    ConfigError,
    ModelNotFoundError,
    QiaoError,
    RequestFailedError,
    RequestTooLargeError,
)
from qiao.hal.platform import default_device, resolve_dtype
from qiao.kernels import cpu_ops
from qiao.layers.linear_method import warm_row_buckets
from qiao.lora.manager import LoRAManager
from qiao.lora.request import LoRARequest
from qiao.models.arch_config import load_arch_config
from qiao.outputs import RequestOutput
from qiao.runner.grammar import GrammarCompiler
from qiao.runner.model_runner import ModelRunner
from qiao.sampling_params import SamplingParams
from qiao.spec_decode.draft import DraftProposer
from qiao.spec_decode.speculator import Speculator
from qiao.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from qiao.tokenizer import load_eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

# How long a prompt that made a step fail is refused.
FAILED_PROMPT_TTL_S = 60.0
# Upper bounds of the tokens-per-step histogram (`iteration_token_counts`, exported as
# `qiao:iteration_tokens_total`): a decode row is 1 token, a prefill chunk up to the step budget.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

PromptType = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig, *, detokenize: bool = True) -> None:
        """`detokenize=False`: outputs carry token ids only (no text, no stop strings, no logprob
        token texts): an engine process whose API process detokenizes. It then loads no
        tokenizer unless the checkpoint names its EOS tokens nowhere else."""
        self.config = config
        mc = config.model
        self.arch = load_arch_config(mc.path)
        load_tokenizer_here = not mc.skip_tokenizer_init and (
            detokenize or not load_eos_token_ids(mc.path, self.arch.eos_token_ids, None)
        )
        self.max_model_len = min(
            mc.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings
        )
        device = default_device() if config.device == "auto" else torch.device(config.device)
        # The tokenizer loads (mostly Python imports) on a worker thread while the weights load
        # (torch ops, which let go of the GIL): a second or two off every start. On the CPU the
        # C++ kernels are then found (or, once per machine, compiled) on the same thread, so that
        # the first step, and a server's first request, never waits for a compiler. One thread,
        # not two: with the kernels loading (torch's extension machinery imports setuptools)
        # beside the tokenizer, a start once failed in transformers' imports with "No module
        # named 'regex'" (installed); the two no longer import at the same time.
        with ThreadPoolExecutor(1, thread_name_prefix="qiao-loader") as pool:
            tokenizer = None
            if load_tokenizer_here:
                tokenizer = pool.submit(load_tokenizer, mc.tokenizer or mc.path)
            kernels = pool.submit(cpu_ops) if device.type == "cpu" else None
            self.runner = self._build_runner(config, device)
            self.tokenizer = tokenizer.result() if tokenizer is not None else None
            if kernels is not None:
                kernels.result()
        self.eos_token_ids = load_eos_token_ids(mc.path, self.arch.eos_token_ids, self.tokenizer)

        cache = config.cache
        # Every running sequence at full length, each rounding up to whole blocks.
        blocks_per_seq = -(-self.max_model_len // cache.block_size)
        max_useful = config.scheduler.max_num_seqs * blocks_per_seq
        self.num_kv_blocks = self.runner.determine_num_blocks(cache, max_useful)
        self.runner.init_kv_cache(self.num_kv_blocks, cache.block_size)
        self.block_manager = BlockManager(
            self.num_kv_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache_reserve=round(cache.prefix_cache_reserve * self.num_kv_blocks),
            # Every layer windowed: blocks out of the window are freed as requests advance.
            sliding_window=self.arch.uniform_sliding_window,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        # Adaptive batching: moves the scheduler's token budget to hold the decode step time
        # at the target (None: off). `step_clock` times the steps (a test injects a fake one).
        self.budget_controller = _budget_controller(config.scheduler)
        self.step_clock: Callable[[], float] = time.perf_counter
        self.output_processor = OutputProcessor(self.tokenizer if detokenize else None)
        self._rng = random.Random(mc.seed)
        self.num_steps = 0
        self.num_computed_tokens_total = 0  # prompt and recomputed tokens plus decode inputs
        self.num_generated_tokens_total = 0
        # Steps per ITERATION_TOKEN_BUCKETS bucket (tokens <= bound), the last one above them all.
        self.iteration_token_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._arrivals = itertools.count()
        # Requests ended alone by a failing step, for the serving loop to answer.
        self.failed_requests: list[tuple[str, QiaoError]] = []
        # Prompts that made a step fail: key -> refused until (time.monotonic()).
        self._refused_prompts: dict[bytes, float] = {}
        self._grammars: GrammarCompiler | None = None
        # Speculative decoding's proposals and counters (qiao/spec_decode); None: off.
        self.speculator = (
            None
            if config.speculative is None
            else Speculator(config.speculative, self._build_draft_proposer(config))
        )
        self._lora_ids = itertools.count(1)
        for name, path in config.lora.lora_modules if config.lora is not None else ():
            self.add_lora(LoRARequest(name, next(self._lora_ids), path))

    def warm_row_buckets(self) -> None:
        """Every oneDNN matmul primitive the steps will use, built now (`warm_row_buckets`):
        the memory they hold is paid at start and flat under load. The server's engine
        processes call it (a long-lived engine); `QIAO_WARM_ROW_BUCKETS=0` skips it."""
        config = self.config
        if self.runner.device.type != "cpu" or self.runner.tp is not None:
            return
        if not envs.warm_row_buckets():
            return
        started = time.monotonic()
        runs = warm_row_buckets(
            self.runner.model,
            self.runner.dtype,
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_num_seqs,
        )
        if runs:
            logger.info(
                "matmul row buckets warmed: %d matmuls in %.2f s", runs, time.monotonic() - started
            )

    def _build_draft_proposer(self, config: EngineConfig) -> DraftProposer | None:
        """The draft model's runner and KV pool (`speculative_method` draft): as many blocks as
        the model's, so every running request can hold its draft copy."""
        spec = config.speculative
        if spec is None or spec.model is None:
            return None
        arch = load_arch_config(spec.model)
        if arch.vocab_size != self.arch.vocab_size:
            raise ConfigError(
                f"speculative_model: its vocabulary has {arch.vocab_size} tokens and the model's "
                f"{self.arch.vocab_size}; a draft model must share the model's tokenizer"
            )
        if arch.max_position_embeddings < self.max_model_len:
            raise ConfigError(
                f"speculative_model: its context is {arch.max_position_embeddings} tokens, "
                f"shorter than max_model_len {self.max_model_len}; lower max_model_len"
            )
        mc = config.model
        runner = ModelRunner(
            arch,
            None if mc.load_format == "dummy" else spec.model,
            dtype=resolve_dtype(mc.dtype, arch.torch_dtype),
            device=self.runner.device,
            load_format=mc.load_format,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            cuda_graphs=config.cuda_graphs,
        )
        runner.init_kv_cache(self.num_kv_blocks, config.cache.block_size)
        blocks = BlockManager(self.num_kv_blocks, config.cache.block_size, False)
        return DraftProposer(runner, blocks, spec.num_speculative_tokens)

    def _build_runner(self, config: EngineConfig, device: torch.device) -> ModelRunner:
        mc = config.model
        dtype = resolve_dtype(mc.dtype, self.arch.torch_dtype, device.type)
        kv_dtype = config.cache.kv_cache_dtype
        return ModelRunner(
            self.arch,
            None if mc.load_format == "dummy" else str(mc.path),
            dtype=dtype,
            kv_cache_dtype=dtype if kv_dtype == "auto" else resolve_dtype(kv_dtype, None),
            device=device,
            load_format=mc.load_format,
            quantization=mc.quantization,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            cuda_graphs=config.cuda_graphs,
            batch_invariant=mc.batch_invariant,
            tensor_parallel_size=config.tensor_parallel_size,
            lora_config=config.lora,
        )

    def step(self) -> list[RequestOutput]:
        """Schedule, execute and update once; return the outputs that are ready.

        A forward that raises is retried in halves (`_isolate`) until the requests that make it
        fail are found: they end alone (`failed_requests`), the rest of the step goes on. After
        an out-of-memory error, later steps are capped to the largest part that ran."""
        started = self.step_clock()
        scheduler_output = self.scheduler.schedule()
        failed: list[RequestOutput] = []
        try:
            runner_output = self.runner.execute(scheduler_output)
        except Exception as exc:
            scheduler_output, runner_output, failed = self._isolate(scheduler_output, exc)
        for request_id, (first, entries) in runner_output.prompt_logprobs.items():
            request = self.scheduler.requests.get(request_id)
            # A recomputed prompt (after preemption) scores positions already kept: skip them.
            if request is not None and len(request.prompt_logprobs) == first:
                request.prompt_logprobs += entries
        updated = self.scheduler.update(scheduler_output, runner_output)
        for request in updated:
            if request.grammar is not None:
                _advance_grammar(request)
        self.num_steps += 1
        num_tokens = scheduler_output.num_scheduled_tokens
        self.num_computed_tokens_total += num_tokens
        if num_tokens:
            self.iteration_token_counts[
                bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)
            ] += 1
        self.num_generated_tokens_total += self.scheduler.num_appended_tokens
        touched, stopped = self.output_processor.process(updated, runner_output)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self.speculator is not None:
            self.speculator.after_step(scheduler_output, runner_output, self.scheduler.running)
        outputs = failed + self._collect(touched)
        if self.budget_controller is not None:
            self._adapt_budget(scheduler_output, self.step_clock() - started)
        return outputs

    def _adapt_budget(self, scheduler_output: SchedulerOutput, step_time_s: float) -> None:
        """Feed the time of a step that held a decode (what running requests wait per token)
        to the controller and hand its choice to the scheduler. It may grow the budget when the
        step used it up or nothing waits (a light load gets the configured budget back)."""
        controller = self.budget_controller
        assert controller is not None
        if not any(
            s.num_computed_tokens >= s.request.num_prompt_tokens for s in scheduler_output.scheduled
        ):
            return  # prefill only: no request is waiting for its next token
        used_up = scheduler_output.num_scheduled_tokens >= controller.value
        new = controller.observe(
            step_time_s * 1000.0, can_grow=used_up or not self.scheduler.num_waiting
        )
        if new is not None:
            self.scheduler.set_token_budget(int(new))

    def take_failed_requests(self) -> list[tuple[str, QiaoError]]:
        """(request id, error) of the requests ended alone since the last call."""
        failed, self.failed_requests = self.failed_requests, []
        return failed

    def _isolate(
        self, scheduler_output: SchedulerOutput, error: Exception
    ) -> tuple[SchedulerOutput, ModelRunnerOutput, list[RequestOutput]]:
        """Re-run a failed step in halves until each failing part is one request; end those
        alone. Returns the step that ran (the others), its output, and the failed ones' final
        outputs (finish_reason "error")."""
        logger.warning(
            "a step of %d requests failed (%s); retrying in halves to find the cause",
            len(scheduler_output.scheduled),
            type(error).__name__,
        )
        good: list[ScheduledRequest] = []
        bad: list[tuple[ScheduledRequest, Exception]] = []
        largest_run = (0, 0)  # (tokens, sequences) of the largest part that ran
        too_big = False  # a part ran out of memory though each of its requests ran
        merged = ModelRunnerOutput()
        rows: list[tuple[list[int], list[float]] | None] = []
        ranks: list[int] = []

        def run(items: list[ScheduledRequest], known_error: Exception | None) -> bool:
            """Run `items` (known to fail with `known_error` if given), halving on failure;
            True when every request in it ran."""
            nonlocal largest_run, too_big
            if not items:
                return True
            if known_error is None:
                try:
                    out = self.runner.execute(_sub_step(items))
                except Exception as exc:
                    known_error = exc
                else:
                    size = (sum(len(i.token_ids) for i in items), len(items))
                    largest_run = max(largest_run, size)
                    good.extend(items)
                    merged.prompt_logprobs.update(out.prompt_logprobs)
                    merged.req_ids += out.req_ids
                    merged.sampled_token_ids += out.sampled_token_ids
                    merged.spec_token_ids.update(out.spec_token_ids)
                    rows.extend(out.logprobs or [None] * len(out.req_ids))
                    ranks.extend(out.sampled_ranks or [0] * len(out.req_ids))
                    return True
            if len(items) == 1:
                bad.append((items[0], known_error))
                return False
            half = len(items) // 2
            all_ran = run(items[:half], None) & run(items[half:], None)
            # Out of memory, yet its parts all ran: the step was too big (and not one request
            # too big even alone, whose failure explains the parts it was in).
            too_big |= all_ran and _is_out_of_memory(known_error)
            return all_ran

        run(scheduler_output.scheduled, error)
        if too_big:
            logger.warning(
                "a step of %d tokens (%d requests) ran out of memory; steps take at most %d "
                "tokens and %d requests for a while",
                scheduler_output.num_scheduled_tokens,
                len(scheduler_output.scheduled),
                *largest_run,
            )
            self.scheduler.cap_step(*largest_run)
        if any(row is not None for row in rows):
            merged.logprobs, merged.sampled_ranks = rows, ranks
        outputs = []
        for item, exc in bad:
            outputs += self._fail_request(item.request, exc)
        return _sub_step(good), merged, outputs

    def _fail_request(self, request: Request, exc: Exception) -> list[RequestOutput]:
        """End the user request `request` belongs to (every sample of it), alone."""
        parent_id, _ = self.output_processor.children.get(request.request_id, (None, 0))
        if parent_id is None:
            return []
        state = self.output_processor.states[parent_id]
        if _is_out_of_memory(exc):
            logger.warning("request %s does not fit in memory even alone; ending it", parent_id)
            error: QiaoError = RequestTooLargeError(
                "prompt: the request does not fit in the engine's memory even alone; shorten "
                "the prompt or lower max_tokens / n"
            )
        else:
            logger.error(
                "request %s makes the engine fail (%s); ending it alone, its prompt refused "
                "for %.0f s",
                parent_id,
                type(exc).__name__,
                FAILED_PROMPT_TTL_S,
                exc_info=exc,
            )
            self._refused_prompts[_prompt_key(state.prompt_token_ids)] = (
                time.monotonic() + FAILED_PROMPT_TTL_S
            )
            error = RequestFailedError(
                f"the engine failed on this request ({type(exc).__name__}) and ended it alone; "
                "the same prompt is refused for a while"
            )
        for child_id in state.child_ids:
            self.scheduler.fail_request(child_id)
            self.output_processor.finish(child_id, "error")
        self.failed_requests.append((parent_id, error))
        return self._collect([parent_id])

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        stream: bool = False,
        arrival_time: float | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> None:
        """Validate and queue a request. Raises ConfigError naming the bad field before any work.

        `lora_request`: the adapter to run under, a `LoRARequest` (registered on first use, as
        vLLM does) or the name of a registered one (ModelNotFoundError when unknown)."""
        if request_id in self.output_processor.states:
            raise ConfigError(f"request_id {request_id!r} is already running")
        lora = self._lora_request(lora_request)
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._refuse_failed_prompt(prompt_ids)
        max_total = self._check_lengths(prompt_ids, params)
        arrival_seq = next(self._arrivals)
        children = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_ids,
                params,
                seed=self._child_seed(params.seed, i),
                eos_token_ids=self.eos_token_ids,
                max_total_tokens=max_total,
                priority=priority,
                arrival_seq=arrival_seq,
                arrival_time=arrival_time,
                lora_request=lora,
            )
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:
            compiler = self._grammar_compiler()
            for child in children:
                child.grammar = compiler.matcher(params.structured_outputs)
        self.output_processor.add_request(request_id, prompt_text, children, stream)
        for child in children:
            self.scheduler.add_request(child)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter (read and checked now); False when it was already."""
        return self._lora_manager().add(lora_request)

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Register the adapter in folder `path` under `name` (a new id: a reload replaces)."""
        request = LoRARequest(name, next(self._lora_ids), path)
        self._lora_manager().add(request)
        return request

    def remove_lora(self, name: str) -> None:
        """Forget an adapter (ModelNotFoundError when unknown); requests running under it finish
        under it (reloaded from its folder if its slot is needed meanwhile)."""
        self._lora_manager().remove(name)

    def list_loras(self) -> list[LoRARequest]:
        manager = self.runner.lora
        return [] if manager is None else list(manager.registered.values())

    def _lora_manager(self) -> LoRAManager:
        if self.runner.lora is None:
            raise ConfigError("LoRA adapters need an engine started with enable_lora")
        return self.runner.lora

    def _lora_request(self, lora: LoRARequest | str | None) -> LoRARequest | None:
        if lora is None:
            return None
        manager = self._lora_manager()
        if isinstance(lora, LoRARequest):
            manager.add(lora)
            return lora
        known = manager.registered.get(lora)
        if known is None:
            names = ", ".join(sorted(manager.registered)) or "none"
            raise ModelNotFoundError(f"LoRA adapter {lora!r} is not loaded (loaded: {names})")
        return known

    def _grammar_compiler(self) -> GrammarCompiler:
        """Built on the first constrained request (the tokenizer loaded then if this engine has
        none: an engine process whose API process detokenizes)."""
        if self._grammars is None:
            mc = self.config.model
            if mc.skip_tokenizer_init:
                raise ConfigError(
                    "structured_outputs: needs the model's tokenizer, and this engine was "
                    "started without one (skip_tokenizer_init)",
                    param="structured_outputs",
                )
            tokenizer = self.tokenizer or load_tokenizer(mc.tokenizer or mc.path)
            self._grammars = GrammarCompiler(tokenizer, self.arch.vocab_size, self.eos_token_ids)
        return self._grammars

    def abort_request(self, request_ids: list[str], reason: str = "abort") -> list[RequestOutput]:
        """End requests wherever they are; their blocks are free when this returns."""
        child_ids = [
            cid
            for rid in request_ids
            if rid in self.output_processor.states
            for cid in self.output_processor.states[rid].child_ids
        ]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        touched = {self.output_processor.finish(cid, reason) for cid in child_ids}
        return self._collect([t for t in touched if t is not None])

    def stop_samples(self, samples: list[tuple[str, int]]) -> list[RequestOutput]:
        """End samples (request id, sample index) that a stop string ended where the text is
        made (the API process of an engine that does not detokenize)."""
        states = self.output_processor.states
        child_ids = [
            states[rid].child_ids[index]
            for rid, index in samples
            if rid in states and index < len(states[rid].child_ids)
        ]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_STOPPED)
        touched = {self.output_processor.finish(cid, "stop") for cid in child_ids}
        return self._collect([t for t in touched if t is not None])

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states)

    @property
    def max_sequence_tokens(self) -> int:
        """The most tokens (prompt + output) one sequence can hold: the context, or the KV pool
        when it is smaller."""
        return min(self.max_model_len, self.num_kv_blocks * self.block_manager.block_size)

    def memory_bytes(self) -> dict[str, int]:
        """What this engine holds in device memory: weights (parameters and buffers, packed
        copies included, and the LoRA slots) and the KV pool."""
        model = self.runner.model
        tensors = [*model.parameters(), *model.buffers()]
        weights = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        if self.runner.lora is not None:
            weights += self.runner.lora.slot_bytes()
        kv = sum(c.numel() * c.element_size() for c in self.runner.kv_caches)
        return {"weights": weights, "kv_cache": kv}

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_waiting_tokens": self.scheduler.num_waiting_tokens,
            "num_steps": self.num_steps,
            "num_computed_tokens_total": self.num_computed_tokens_total,
            "num_generated_tokens_total": self.num_generated_tokens_total,
            "iteration_token_counts": list(self.iteration_token_counts),
            "kv_cache_usage": bm.usage,
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queried_tokens": bm.num_queried_tokens,
            "prefix_cache_hit_tokens": bm.num_hit_tokens,
            **(self.speculator.stats.as_dict() if self.speculator is not None else {}),
            **self._adaptive_stats(),
        }

    def _adaptive_stats(self) -> dict[str, Any]:
        controller = self.budget_controller
        if controller is None:
            return {}
        smoothed = controller.smoothed
        return {
            "adaptive_token_budget": int(controller.value),
            "adaptive_step_time_seconds": 0.0 if smoothed is None else smoothed / 1000.0,
            "adaptive_budget_changes": controller.num_changes,
        }

    def _collect(self, parent_ids: list[str]) -> list[RequestOutput]:
        outputs = (self.output_processor.make_output(pid) for pid in parent_ids)
        return [o for o in outputs if o is not None]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError("prompt must not be empty")
            if self.tokenizer is None:
                raise ConfigError("prompt must be token ids: the engine has no tokenizer")
            return prompt, list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        if not ids:
            raise ConfigError("prompt must not be empty (got no token ids)")
        vocab = self.arch.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        return None, ids

    def _check_lengths(self, prompt_ids: list[int], params: SamplingParams) -> int:
        num_prompt = len(prompt_ids)
        if num_prompt >= self.max_model_len:
            raise ConfigError(
                f"prompt is {num_prompt} tokens; the model's context (max_model_len) is "
                f"{self.max_model_len}, which leaves no room to generate: shorten the prompt"
            )
        max_total = self.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, num_prompt + params.max_tokens)
        needed = self.block_manager.blocks_needed(max_total)
        if needed > self.num_kv_blocks:
            raise ConfigError(
                f"max_tokens: the request needs {needed} KV blocks but the cache has "
                f"{self.num_kv_blocks}; lower max_tokens or raise kv_cache_memory"
            )
        return max_total

    def _refuse_failed_prompt(self, prompt_ids: list[int]) -> None:
        if not self._refused_prompts:
            return
        now = time.monotonic()
        for key in [k for k, until in self._refused_prompts.items() if until <= now]:
            del self._refused_prompts[key]
        until = self._refused_prompts.get(_prompt_key(prompt_ids))
        if until is not None:
            raise RequestFailedError(
                "this prompt made the engine fail moments ago; it is refused for "
                f"{until - now:.0f} s more"
            )

    def _child_seed(self, seed: int | None, index: int) -> int:
        """Sample i of a seeded request gets a seed derived from (seed, i); sample 0 the seed."""
        if seed is None:
            return self._rng.getrandbits(63)
        if index == 0:
            return seed
        digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1


def _budget_controller(config: SchedulerConfig) -> BudgetController | None:
    """The step-budget controller of `config.target_itl_ms` (milliseconds), None when unset:
    from the configured budget (the tuning profile's when it set it) down to the minimum."""
    if config.target_itl_ms is None:
        return None
    hi = config.max_num_batched_tokens
    return BudgetController(
        config.target_itl_ms,
        config.target_itl_tolerance,
        lo=min(config.adaptive_min_batched_tokens, hi),
        hi=hi,
        start=hi,
        name="token budget",
    )


def _advance_grammar(request: Request) -> None:
    """Feed the sampled token to the request's matcher. A finished grammar (its EOS taken, and
    `ignore_eos` going on) constrains nothing more; a token it refuses (one the sampler had to
    pick past the mask: `min_tokens` over a finished grammar) ends the constraint, logged."""
    matcher = request.grammar
    token = request.output_token_ids[-1]
    accepted = matcher.consume_token(token)
    if accepted and matcher.is_stopped() and token in request.eos_token_ids:
        request.grammar = None
        return
    if not accepted or matcher.is_error():
        logger.warning(
            "request %s: the structured-output constraint ended (%s); sampling goes on "
            "unconstrained",
            request.request_id,
            matcher.get_error() or "token outside the grammar",
        )
        request.grammar = None


def _sub_step(items: list[ScheduledRequest]) -> SchedulerOutput:
    """A step of only `items` (the same requests' shares, nothing else)."""
    return SchedulerOutput(
        scheduled=list(items), num_scheduled_tokens=sum(len(s.token_ids) for s in items)
    )


def _is_out_of_memory(exc: Exception) -> bool:
    return isinstance(exc, MemoryError | torch.OutOfMemoryError)


def _prompt_key(prompt_ids: list[int]) -> bytes:
    return hashlib.sha256(repr(prompt_ids).encode()).digest()


__all__ = ["LLMEngine", "ModelRunnerOutput"]
