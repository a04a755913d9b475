"""The Ray Serve request router of `qiao serve --ray` replicas (runs in the API process).

A prompt with an affinity key (its first `--prefix-affinity-tokens` tokens, hashed) goes to the
replica the key ranks first by rendezvous hashing over the replica ids, unless that replica
holds `load_slack` more requests than the least loaded one; every other request goes to the
least loaded replica (Ray Serve picks the shortest queue within a rank).

Ray ships this module by value to the process that routes, so it holds nothing but the class:
the registry of routers lives in `ray_replicas`.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, RequestRouter

from qiao.engine.replicas import affinity_order


class PrefixAffinityRouter(FIFOMixin, RequestRouter):  # type: ignore[misc]
    def initialize_state(self, load_slack: int = 8, **kwargs: Any) -> None:
        self.load_slack = load_slack
        self.routed: dict[str, int] = {}
        self.routed_by_affinity: dict[str, int] = {}
        self._affine: dict[str, str] = {}  # pending request id -> the replica affinity chose

    def update_replicas(self, replicas: list[Any]) -> None:
        super().update_replicas(replicas)
        self._register()

    def _register(self) -> None:
        from qiao.engine.ray_replicas import ROUTERS

        ROUTERS[self.app_name] = self

    def load(self, replica: Any) -> int:
        """Requests the replica holds: its queue length as last probed, else its last stats."""
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        if cached is not None:
            return int(cached)
        return int((replica.routing_stats or {}).get("num_unfinished", 0))

    async def choose_replicas(
        self, candidate_replicas: list[Any], pending_request: Any = None
    ) -> list[list[Any]]:
        self._register()
        key = None if pending_request is None else pending_request.kwargs.get("affinity")
        if not key or len(candidate_replicas) < 2:
            return [candidate_replicas]
        ids = [r.replica_id.unique_id for r in candidate_replicas]
        affine = candidate_replicas[affinity_order(key.encode(), ids)[0]]
        least = min(self.load(r) for r in candidate_replicas)
        if self.load(affine) - least > self.load_slack:
            return [candidate_replicas]
        self._affine[pending_request.metadata.internal_request_id] = affine.replica_id.unique_id
        return [[affine], [r for r in candidate_replicas if r is not affine]]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        rid = replica_id.unique_id
        self.routed[rid] = self.routed.get(rid, 0) + 1
        if self._affine.pop(pending_request.metadata.internal_request_id, None) == rid:
            self.routed_by_affinity[rid] = self.routed_by_affinity.get(rid, 0) + 1
