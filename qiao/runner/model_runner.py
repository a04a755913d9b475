"""The device step: one flat token batch in, one sampled token per finishing chunk out.

The runner owns every device tensor: the weights, the paged KV cache and the step inputs. It turns
a `SchedulerOutput` into flat `input_ids` / `positions` / `slot_mapping` (no padding), runs the
model, computes logits only for the last token of each sequence that samples, and samples.
Pure-decode steps may instead run padded to a static bucket and replay a CUDA graph
(`cuda_graphs.DecodeGraphs`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from typing import Any

import numpy as np
import torch

from qiao import envs
from qiao.attention.metadata import AttentionMetadata
from qiao.config import (
    DEFAULT_CPU_KV_CAP_BYTES,
    DEFAULT_CPU_KV_FRACTION,
    DEFAULT_GPU_KV_FRACTION,
    CacheConfig,
    LoRAConfig,
)
from qiao.distributed.parallel_state import divide, tp_rank
from qiao.errors import ConfigError
from qiao.hal import platform
from qiao.hal.platform import to_device_async, total_memory_bytes
from qiao.layers.attention import Attention
from qiao.lora.manager import LoRAManager
from qiao.lora.steps import merge_outputs, sub_step
from qiao.models.arch_config import ArchConfig
from qiao.models.loader import load_model
from qiao.runner.cuda_graphs import DecodeGraphs, DecodeLayout, resolve_cuda_graphs
from qiao.runner.grammar import MaskFiller, apply_token_bitmask
from qiao.runner.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from qiao.runner.tensor_parallel import StepLayout, TPDriver
from qiao.spec_decode import verify
from qiao.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        arch: ArchConfig,
        model_dir: str | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
        load_format: str,
        kv_cache_dtype: torch.dtype | None = None,
        quantization: str | None = None,
        max_num_seqs: int = 128,
        max_model_len: int | None = None,
        cuda_graphs: bool | None = None,
        batch_invariant: bool = False,
        tensor_parallel_size: int = 1,
        tp_worker: bool = False,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """`tensor_parallel_size` > 1: this runner is rank 0 and starts the other ranks'
        worker processes (`tensor_parallel`) before it builds its slice of the model;
        `tp_worker`: it is one of those (its group is joined already)."""
        self.tp: TPDriver | None = None
        if tensor_parallel_size > 1 and not tp_worker:
            self.tp = TPDriver(
                tensor_parallel_size,
                {
                    "arch": dataclasses.asdict(arch),
                    "model_dir": model_dir,
                    "dtype": str(dtype).removeprefix("torch."),
                    "kv_cache_dtype": str(kv_cache_dtype or dtype).removeprefix("torch."),
                    "device": str(device),
                    "load_format": load_format,
                    "quantization": quantization,
                    "max_num_seqs": max_num_seqs,
                    "max_model_len": max_model_len,
                    "batch_invariant": batch_invariant,
                },
                device,
            )
            cuda_graphs = False  # every rank would have to replay its own graph in step
        self.arch = arch
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype or dtype  # the KV cache's storage dtype
        self.device = device
        self.max_num_seqs = max_num_seqs
        # This rank's key-value heads (all of them without tensor parallelism).
        self.num_kv_heads = divide(arch.num_key_value_heads, "num_key_value_heads")
        self.max_model_len = max_model_len or arch.max_position_embeddings
        # None: on for CUDA. Pure-decode steps then replay a captured graph (see cuda_graphs).
        # (Not under LoRA: a captured graph would bake in one step's adapter plan.)
        self.use_cuda_graphs = lora_config is None and resolve_cuda_graphs(cuda_graphs, device)
        self.decode_graphs: DecodeGraphs | None = None
        self.model = load_model(
            model_dir,
            arch,
            dtype=dtype,
            device=device,
            load_format=load_format,
            quantization=quantization,
            batch_hint=max_num_seqs,
            batch_invariant=batch_invariant,
        )
        if batch_invariant:
            # Attention row by row through the paged kernel as well (cpu_paged).
            for module in self.model.modules():
                if isinstance(module, Attention) and module.backend_name == "auto":
                    module.backend_name = "cpu_invariant"
        # The adapters' device slots and CPU cache (qiao/lora), when serving adapters.
        self.lora = (
            None
            if lora_config is None
            else LoRAManager(self.model, lora_config, dtype=dtype, device=device)
        )
        self.sampler = Sampler()
        self._mask_filler: MaskFiller | None = None  # on the first structured-output step
        self.kv_caches: list[torch.Tensor] = []
        self.prefault_thread: threading.Thread | None = None  # the CPU KV pool's (init_kv_cache)
        self.block_size = 16

    @classmethod
    def for_worker(cls, args: dict[str, Any]) -> ModelRunner:
        """A tensor-parallel worker rank's runner, from what rank 0 sent (`TPDriver`)."""
        arch_fields = dict(args["arch"])
        arch_fields["eos_token_ids"] = tuple(arch_fields["eos_token_ids"])
        device = torch.device(args["device"])
        if device.type == "cuda":
            device = torch.device("cuda", tp_rank())
            torch.cuda.set_device(device)
        return cls(
            ArchConfig(**arch_fields),
            args["model_dir"],
            dtype=getattr(torch, args["dtype"]),
            kv_cache_dtype=getattr(torch, args["kv_cache_dtype"]),
            device=device,
            load_format=args["load_format"],
            quantization=args["quantization"],
            max_num_seqs=args["max_num_seqs"],
            max_model_len=args["max_model_len"],
            cuda_graphs=False,
            batch_invariant=args["batch_invariant"],
            tp_worker=True,
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        if self.tp is not None:
            self.tp.close()

    def kv_bytes_per_block(self, block_size: int) -> int:
        arch = self.arch
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * arch.num_hidden_layers * block_size * self.num_kv_heads * arch.head_dim * elem

    def determine_num_blocks(self, cache: CacheConfig, max_useful_blocks: int) -> int:
        """Pool size from the cache config; by default never more than can ever be in use."""
        per_block = self.kv_bytes_per_block(cache.block_size)
        useful = max_useful_blocks
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
            if budget <= 1.0:
                budget *= total_memory_bytes(self.device)
            num = int(budget // per_block)
            if num < 1:
                raise ConfigError(
                    f"kv_cache_memory {cache.kv_cache_memory} holds no KV block "
                    f"(one block is {per_block} bytes)"
                )
            return num
        if self.device.type == "cpu":
            budget = min(
                DEFAULT_CPU_KV_FRACTION * total_memory_bytes(self.device), DEFAULT_CPU_KV_CAP_BYTES
            )
        else:
            budget = DEFAULT_GPU_KV_FRACTION * total_memory_bytes(self.device)
        return max(1, min(int(budget // per_block), useful))

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the pool's `num_blocks` blocks plus the scratch block (id `num_blocks`, never
        handed out) that padded decode rows write to; then capture the decode graphs if on."""
        arch = self.arch
        if self.tp is not None:
            self.tp.init_kv(num_blocks, block_size)
        shape = (2, num_blocks + 1, block_size, self.num_kv_heads, arch.head_dim)
        # Zeros, not empty: masked-out slots must never hold NaN bit patterns.
        self.kv_caches = [
            platform.zeros(shape, self.kv_dtype, self.device) for _ in range(arch.num_hidden_layers)
        ]
        self.block_size = block_size
        self.model.bind_kv_caches(self.kv_caches)
        if self.device.type == "cpu" and envs.kv_prefault():
            # Now, not at start-up's beginning (it would slow the load beside it) nor paced
            # with use (see prefault_in_background): the engine is built, so at most the last
            # moments of a start share a core with it.
            self.prefault_thread = platform.prefault_in_background(
                self.kv_caches, _prefault_order(self.kv_caches), "KV pool"
            )
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB, %s)",
            num_blocks,
            block_size,
            num_blocks * self.kv_bytes_per_block(block_size) / 2**20,
            str(self.kv_dtype).removeprefix("torch."),
        )
        if self.use_cuda_graphs:
            self.enable_padded_decode(capture=True)

    def enable_padded_decode(self, capture: bool) -> None:
        """Run pure-decode steps through static, padded buffers (`cuda_graphs.DecodeGraphs`),
        replaying CUDA graphs with `capture`; without it (CPU tests) the same path runs eagerly."""
        num_blocks = self.kv_caches[0].shape[1] - 1
        elem = self.kv_caches[0].element_size()
        layout = DecodeLayout(
            block_size=self.block_size,
            scratch_block=num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_blocks=min(num_blocks, -(-self.max_model_len // self.block_size)),
            kv_bytes_per_token=2 * self.num_kv_heads * self.arch.head_dim * elem,
        )
        self.decode_graphs = DecodeGraphs(self.model, layout, self.device)
        if capture:
            self.decode_graphs.capture()

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return ModelRunnerOutput()
        if self.lora is not None:
            # More adapters than device slots: run the step in parts that fit.
            parts = self.lora.split([s.request.lora_request for s in scheduled])
            if parts is not None:
                return merge_outputs(
                    [self.execute(sub_step([scheduled[i] for i in rows])) for rows in parts]
                )
        hidden = None
        prompt_logprobs: dict[str, Any] = {}
        if self.decode_graphs is not None:
            # Row i is sequence i's one token, or None: not pure decode, or no bucket fits.
            hidden = self.decode_graphs.run(scheduler_output)
            last_token = np.arange(len(scheduled))
        if hidden is None:
            layout = self._layout(scheduler_output)
            if self.tp is not None:
                self.tp.forward(layout)
            input_ids, positions, metadata = self._inputs(layout)
            hidden = self._forward(scheduled, input_ids, positions, metadata)
            # The last token of sequence i sits at query_start_loc[i + 1] - 1.
            last_token = metadata.query_start_loc_cpu[1:] - 1
            if any(s.request.needs_prompt_logprobs for s in scheduled):
                prompt_logprobs = self._prompt_logprobs(
                    scheduled, hidden, metadata.query_start_loc_cpu
                )
        sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
        if not sample_rows:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        requests = [scheduled[i].request for i in sample_rows]
        drafts = [scheduled[i].spec_token_ids for i in sample_rows]
        num_drafts = np.fromiter(map(len, drafts), np.int64, len(drafts))
        # A request verifying k draft tokens samples its last 1 + k positions (spec_decode).
        rows = to_device_async(verify.logit_rows(last_token[sample_rows], num_drafts), self.device)
        logits = self._logits(hidden, rows)
        first_rows = verify.group_starts(num_drafts)
        constrained = [j for j, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            self._apply_grammars(
                logits, [requests[j].grammar for j in constrained], first_rows[constrained].tolist()
            )
        sampling_rows = [
            SamplingRow(r.params, r.seed, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids)
            for r in requests
        ]
        speculative = bool(num_drafts.any())
        if speculative:
            sampling_rows = verify.expand_sampling_rows(sampling_rows, drafts)
        sampling = SamplingMetadata.from_rows(
            sampling_rows, vocab_size=logits.shape[-1], device=self.device
        )
        sampled = self.sampler(logits, sampling)
        if speculative:
            out = self._verify(requests, drafts, num_drafts, sampled)
        else:
            out = self._to_output(requests, sampled)
        out.prompt_logprobs = prompt_logprobs
        return out

    def _verify(
        self,
        requests: list[Any],
        drafts: list[list[int]],
        num_drafts: np.ndarray,
        sampled: SamplerOutput,
    ) -> ModelRunnerOutput:
        """A step with draft tokens: each request's first token and accepted run
        (`spec_decode.verify`); logprobs (of requests that do not speculate) from first rows."""
        firsts, runs = verify.accept_drafts(sampled.sampled_token_ids, num_drafts, drafts)
        if sampled.logprob_token_ids is None:
            out = ModelRunnerOutput(
                req_ids=[r.request_id for r in requests], sampled_token_ids=firsts
            )
        else:
            rows = torch.from_numpy(verify.group_starts(num_drafts)).to(self.device)
            out = self._to_output(requests, verify.first_rows(sampled, rows))
        out.spec_token_ids = {
            r.request_id: run for r, run, k in zip(requests, runs, num_drafts, strict=True) if k
        }
        return out

    def _prompt_logprobs(
        self, scheduled: list[Any], hidden: torch.Tensor, starts: np.ndarray
    ) -> dict[str, tuple[int, list[tuple[list[int], list[float], int]]]]:
        """Logprobs of the prompt tokens this step's prefill chunks predict: position p's
        logits score prompt token p + 1 (its logprob and rank, and the top-k), in float32."""
        rows: list[int] = []
        targets: list[int] = []
        ks: list[int] = []
        spans: list[tuple[str, int, int]] = []  # (request id, first position, count)
        for i, s in enumerate(scheduled):
            request = s.request
            if not request.needs_prompt_logprobs:
                continue
            first = s.num_computed_tokens
            last = min(first + len(s.token_ids), len(request.prompt_token_ids) - 1)
            if last <= first:
                continue
            base = int(starts[i])
            rows += range(base, base + last - first)
            targets += request.prompt_token_ids[first + 1 : last + 1]
            ks += [request.params.prompt_logprobs] * (last - first)
            spans.append((request.request_id, first, last - first))
        entries: list[tuple[list[int], list[float], int]] = []
        top_k = max(ks, default=0)
        for begin in range(0, len(rows), _PROMPT_LOGPROB_ROWS):
            end = begin + _PROMPT_LOGPROB_ROWS
            index = torch.tensor(rows[begin:end], device=hidden.device)
            target = torch.tensor(targets[begin:end], device=hidden.device)
            logprobs = torch.log_softmax(self._logits(hidden, index).float(), dim=-1)
            chosen = logprobs.gather(1, target[:, None])
            ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
            top_values, top_ids = logprobs.topk(top_k, dim=-1) if top_k else (chosen[:, :0],) * 2
            for j, (token, value, rank, ids, values) in enumerate(
                zip(
                    target.tolist(),
                    chosen[:, 0].tolist(),
                    ranks,
                    top_ids.tolist(),
                    top_values.tolist(),
                    strict=True,
                )
            ):
                k = ks[begin + j]
                entries.append(([token, *ids[:k]], [value, *values[:k]], rank))
        result = {}
        offset = 0
        for request_id, first, count in spans:
            result[request_id] = (first, entries[offset : offset + count])
            offset += count
        return result

    def _apply_grammars(self, logits: torch.Tensor, matchers: list[Any], rows: list[int]) -> None:
        """Mask the logits of structured-output rows to the tokens their grammar allows."""
        if self._mask_filler is None:
            self._mask_filler = MaskFiller(logits.shape[-1])
        bitmask = self._mask_filler.fill(matchers)
        apply_token_bitmask(logits, bitmask, None if len(rows) == len(logits) else rows)

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits of `hidden[rows]`; with tensor parallelism every rank computes them too."""
        if self.tp is not None:
            self.tp.logits(rows)
        return self.model.compute_logits(hidden[rows])

    def _forward(
        self,
        scheduled: list[Any],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The model's forward, under the step's LoRA plan when adapters are served."""
        if self.lora is None:
            return self.model(input_ids, positions, metadata)
        query_lens = np.diff(metadata.query_start_loc_cpu)
        with self.lora.step([s.request.lora_request for s in scheduled], query_lens):
            return self.model(input_ids, positions, metadata)

    def forward_layout(self, layout: StepLayout) -> torch.Tensor:
        """A worker rank's forward of the step rank 0 sent."""
        input_ids, positions, metadata = self._inputs(layout)
        return self.model(input_ids, positions, metadata)

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return self._inputs(self._layout(scheduler_output))

    def _layout(self, scheduler_output: SchedulerOutput) -> StepLayout:
        """The step's flat batch as host arrays."""
        scheduled = scheduler_output.scheduled
        num_seqs = len(scheduled)
        num_tokens = scheduler_output.num_scheduled_tokens
        query_lens = np.fromiter((len(s.token_ids) for s in scheduled), np.int64, num_seqs)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, num_seqs)
        token_ids = itertools.chain.from_iterable(s.token_ids for s in scheduled)
        input_ids = np.fromiter(token_ids, np.int64, num_tokens)
        # E.g. query lens [2, 5, 3] -> [0, 2, 7, 10]
        query_start_loc = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        # E.g. query lens [2, 3], starts [5, 0] -> seq_idx [0, 0, 1, 1, 1], positions [5, 6, 0, 1, 2]
        seq_idx = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - query_start_loc[seq_idx] + starts[seq_idx]
        seq_lens = starts + query_lens
        max_blocks = max(len(s.block_ids) for s in scheduled)
        block_tables = np.zeros((num_seqs, max_blocks), np.int64)
        for i, s in enumerate(scheduled):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        bs = self.block_size
        slot_mapping = block_tables[seq_idx, positions // bs] * bs + positions % bs
        return StepLayout(
            input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables
        )

    def _inputs(self, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Device tensors and the attention metadata of a step's layout."""

        def dev(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return to_device_async(array, self.device, dtype)

        query_start_loc, seq_lens = layout.query_start_loc, layout.seq_lens
        positions_t = dev(layout.positions, torch.int64)
        metadata = AttentionMetadata(
            num_tokens=len(layout.input_ids),
            num_seqs=len(seq_lens),
            block_size=self.block_size,
            slot_mapping=dev(layout.slot_mapping, torch.int64),
            positions=positions_t,
            query_start_loc=dev(query_start_loc, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            block_tables=dev(layout.block_tables, torch.int32),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=int(seq_lens.max()),
        )
        return dev(layout.input_ids, torch.int64), positions_t, metadata

    def _to_output(self, requests: list, sampled) -> ModelRunnerOutput:
        out = ModelRunnerOutput(
            req_ids=[r.request_id for r in requests],
            sampled_token_ids=sampled.sampled_token_ids.tolist(),
        )
        if sampled.logprob_token_ids is None:
            return out
        ids = sampled.logprob_token_ids.tolist()
        values = sampled.logprobs.tolist()
        out.sampled_ranks = sampled.sampled_ranks.tolist()
        out.logprobs = []
        for r, row_ids, row_values in zip(requests, ids, values, strict=True):
            k = r.params.logprobs
            out.logprobs.append(None if k is None else (row_ids[: 1 + k], row_values[: 1 + k]))
        return out


# Prompt positions scored per logits matrix (rows x vocabulary floats at a time).
_PROMPT_LOGPROB_ROWS = 256


def _prefault_order(caches: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(cache index, byte offset, byte length) of every layer's K and V, ~2 MiB of blocks at a
    time in block order: the order the block manager hands fresh blocks out in."""
    _, num_blocks, *_ = caches[0].shape
    block_bytes = caches[0][0, 0].numel() * caches[0].element_size()
    step = max(1, (2 << 20) // block_bytes)
    return [
        (
            index,
            (kv * num_blocks + first) * block_bytes,
            min(step, num_blocks - first) * block_bytes,
        )
        for first in range(0, num_blocks, step)
        for index in range(len(caches))
        for kv in (0, 1)
    ]
