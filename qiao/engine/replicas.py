"""Data parallelism on one machine: N engine replicas of one model behind one `EngineClient`.

Each replica is a full engine (its own process, KV cache and scheduler), pinned by the caller
to its own cores or GPU. `ReplicatedEngine` routes every API request (all its prompts and
samples together, so its admission stays all-or-none) to one replica:

- **prefix affinity**: a prompt of at least `affinity_tokens` tokens goes where its first
  `affinity_tokens` tokens hash to (rendezvous hashing over the replicas, so adding or losing
  one moves only its share), so requests sharing a long prefix meet that replica's prefix cache;
- **least loaded** otherwise, or when the affine replica holds `load_slack` more requests than
  the least loaded one (affinity never piles work on one replica);
- a replica that cannot take the request now (restarting, draining, its breaker open, its
  queue full) is skipped for the next in that order; only when none can is the last refusal
  raised, so a client sees one replica's fault only when every replica has it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from qiao.engine.async_engine import EngineClient, EngineHealth, GenerateRequest
from qiao.engine.breaker import BreakerState, CircuitBreaker
from qiao.errors import ConfigError, EngineUnavailableError, QueueFullError
from qiao.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Refusals that mean "this replica, not now": the next replica may take the request.
_PASSING = (EngineUnavailableError, QueueFullError)


def split_cpus(cpus: Sequence[int], replicas: int) -> list[list[int]]:
    """`cpus` in `replicas` disjoint, contiguous, near-equal sets (a ConfigError when there
    are fewer cpus than replicas)."""
    cpus = sorted(cpus)
    if replicas > len(cpus):
        raise ConfigError(
            f"data_parallel_size {replicas}: this process may use {len(cpus)} cpu(s); each "
            "replica needs at least one"
        )
    base, extra = divmod(len(cpus), replicas)
    out, start = [], 0
    for i in range(replicas):
        size = base + (i < extra)
        out.append(cpus[start : start + size])
        start += size
    return out


def affinity_order(key: bytes, names: Sequence[str]) -> list[int]:
    """Indices of `names` (replica ids) by rendezvous weight for `key`, highest first."""

    def weight(i: int) -> bytes:
        return hashlib.blake2b(key + names[i].encode(), digest_size=8).digest()

    return sorted(range(len(names)), key=weight, reverse=True)


def merge_replica_stats(each: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Replicas' stats as one engine's: figures summed (KV usage averaged, the most open
    breaker, up when any is), lists summed column by column."""
    out: dict[str, Any] = {}
    for key, value in each[0].items():
        values = [s.get(key) for s in each]
        if isinstance(value, bool) or not all(isinstance(v, int | float) for v in values):
            if isinstance(value, list) and all(isinstance(v, list) for v in values):
                out[key] = [sum(column) for column in zip(*values, strict=True)]
            else:
                out[key] = value
            continue
        out[key] = sum(values)  # type: ignore[arg-type]
    for key in ("kv_cache_usage", "breaker_state"):
        if key in out:
            values = [s[key] for s in each]
            out[key] = sum(values) / len(values) if key == "kv_cache_usage" else max(values)
    if "engine_up" in out:
        out["engine_up"] = int(any(s.get("engine_up") for s in each))
    return out


class ReplicatedEngine(EngineClient):
    def __init__(
        self,
        replicas: Sequence[EngineClient],
        *,
        affinity_tokens: int = 64,
        load_slack: int = 8,
    ) -> None:
        if not replicas:
            raise ConfigError("ReplicatedEngine needs at least one replica")
        self.replicas = list(replicas)
        self.affinity_tokens = affinity_tokens
        self.load_slack = load_slack
        # API requests (groups) routed to each replica, and of them those sent by affinity.
        self.routed = [0] * len(self.replicas)
        self.routed_by_affinity = [0] * len(self.replicas)

    # --- routing -------------------------------------------------------------------------------

    def route(self, requests: Sequence[GenerateRequest]) -> tuple[list[int], bool]:
        """Replica indices to try, in order, and whether the first is the affine one."""
        loads = [r.num_unfinished() for r in self.replicas]
        by_load = sorted(range(len(self.replicas)), key=lambda i: (loads[i], i))
        prompt = requests[0].prompt_token_ids if requests else []
        if self.affinity_tokens <= 0 or len(prompt) < self.affinity_tokens:
            return by_load, False
        head = b"".join(
            t.to_bytes(4, "little", signed=True) for t in prompt[: self.affinity_tokens]
        )
        affine = affinity_order(head, [str(i) for i in range(len(self.replicas))])[0]
        if loads[affine] - loads[by_load[0]] > self.load_slack:
            return by_load, False
        return [affine, *(i for i in by_load if i != affine)], True

    def generate_all(self, requests: Sequence[GenerateRequest]) -> list[Any]:
        order, affine = self.route(requests)
        refusal: Exception | None = None
        for position, index in enumerate(order):
            try:
                streams = self.replicas[index].generate_all(requests)
            except _PASSING as exc:
                refusal = exc
                continue
            self.routed[index] += 1
            if affine and position == 0:
                self.routed_by_affinity[index] += 1
            return streams
        assert refusal is not None
        raise refusal

    # --- the rest of EngineClient: every replica ------------------------------------------------

    @property  # type: ignore[override]
    def draining(self) -> bool:
        return all(r.draining for r in self.replicas)

    @draining.setter
    def draining(self, value: bool) -> None:
        for r in self.replicas:
            r.draining = value

    @property  # type: ignore[override]
    def breaker(self) -> CircuitBreaker:
        """The most open of the replicas' breakers (each replica keeps its own)."""
        openness = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
        return max((r.breaker for r in self.replicas), key=lambda b: openness[b.state])

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()

    def add_output_listener(self, listener: Callable[[list[RequestOutput]], None]) -> None:
        for r in self.replicas:
            r.add_output_listener(listener)

    def num_unfinished(self) -> int:
        return sum(r.num_unfinished() for r in self.replicas)

    def abort_all(self, reason: str = "abort") -> None:
        for r in self.replicas:
            r.abort_all(reason)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        for r in self.replicas:  # each ignores an id it does not hold
            r.abort(request_id, reason)

    @property
    def tokenizer(self) -> Any:
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def max_sequence_tokens(self) -> int:
        return min(r.max_sequence_tokens for r in self.replicas)

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    def health(self) -> EngineHealth:
        """Ready while any replica is (the router skips the others)."""
        healths = [r.health() for r in self.replicas]
        if any(h.is_ready for h in healths):
            return EngineHealth(True)
        reasons = "; ".join(f"replica {i}: {h.reason}" for i, h in enumerate(healths))
        return EngineHealth(False, reasons)

    def lora_adapters(self) -> dict[str, str]:
        return self.replicas[0].lora_adapters()

    async def load_lora(self, name: str, path: str) -> None:
        """On every replica, one after another (a failure on the first changes none)."""
        for replica in self.replicas:
            await replica.load_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        for replica in self.replicas:
            await replica.unload_lora(name)

    def stats(self) -> dict[str, Any]:
        """The replicas' figures summed (KV usage averaged), and each replica's own."""
        each = [r.stats() for r in self.replicas]
        out = merge_replica_stats(each)
        out["replicas"] = [
            {
                "num_unfinished": r.num_unfinished(),
                "routed": self.routed[i],
                "routed_by_affinity": self.routed_by_affinity[i],
                "up": int(r.health().is_ready),
                "engine_restarts": each[i].get("engine_restarts", 0),
            }
            for i, r in enumerate(self.replicas)
        ]
        return out
