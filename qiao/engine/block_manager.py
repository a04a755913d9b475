"""The paged KV cache's bookkeeping: one fixed pool of blocks, reference counted, prefix cached.

The block manager is the scheduler's only door to memory. It never touches tensors: a block is an
id into the runner's cache tensors. Invariants (checked by `check_invariants` in tests):

- every block is either referenced (ref_cnt > 0, owned by >= 1 request), or in the free queue,
  or fresh (never handed out: ids from `next_fresh` up);
- a block's ref_cnt equals the number of requests whose block table holds it;
- the prefix-cache map points only at blocks whose `block_hash` is that key.

Prefix caching: a full block is named by a chained hash of its tokens and its parent block's
hash, so equal hashes mean equal whole prefixes. Freed blocks keep their hash and stay in the free
queue in LRU order; a later request with the same prefix takes them back instead of recomputing,
and allocation evicts from the least recently freed end (blocks that hold no cached prefix sit
there first: they are worth nothing).

Warm first: allocation reuses a freed block before it hands out a fresh one once the free queue
holds more than `cache_reserve` blocks (kept as prefix cache; by default the whole pool, so
nothing cached is evicted while fresh blocks remain). A smaller reserve keeps the memory a server
uses near its load instead of cycling through the pool; that matters where a block's first touch
is dear (a CPU pool left to fault in on first use, `QIAO_KV_PREFAULT=0`: on a VM whose host backs
guest memory lazily, ~3 ms per 2 MiB).

Sliding window (`sliding_window`, set only when every layer of the model attends within one):
a request's blocks that lie wholly before the window of its next computed token are never read
again, so `allocate_slots` hands them back while the request runs. Its block table keeps their
places as None entries (`get_block_ids` reports block 0 there, a valid id attention never reads
through: the window masks those positions). They go to the free queue like any freed block,
keeping their prefix hash: a later request with the same prefix may take one back only while it
still holds that prefix (reuse drops the hash), and a prefix hit is a chain from the first
block, so it never reaches past a block that was reused.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from qiao.engine.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: equal hashes mean equal prefixes up to this block."""
    h = hashlib.sha256(parent_hash or b"qiao")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def _root_hash(request: Request) -> bytes | None:
    lora = getattr(request, "lora_request", None)
    return None if lora is None else lora.block_hash_root


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        cache_reserve: int | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """`cache_reserve`: freed blocks kept (as prefix cache) before fresh ones are handed out;
        default the whole pool. Without prefix caching nothing is kept. `sliding_window`: the
        window every layer attends within (None: some layer sees the whole context); blocks
        that fall out of it are freed as requests advance."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        reserve = num_blocks if cache_reserve is None else cache_reserve
        self.cache_reserve = reserve if enable_prefix_caching else 0
        self.sliding_window = sliding_window
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks handed out before and now unreferenced, least recently freed first (uncached
        # ones at the front). Cached ones keep their hash here.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict()
        # Blocks next_fresh.. were never handed out (their memory may never have been touched).
        self.next_fresh = 0
        self.cached: dict[bytes, KVBlock] = {}
        # A request's block table; None where a block out of the window was freed.
        self.req_to_blocks: dict[str, list[KVBlock | None]] = {}
        # How many leading entries of each request's table were freed out of the window.
        self.num_windowed_out: dict[str, int] = {}
        # How many leading blocks of each request were already offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens, for metrics.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + self.num_blocks - self.next_fresh

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a waiting request: (blocks, tokens they cover).

        At least one token is always left to compute, since the step must produce logits for the
        last one. Takes no references; `allocate_slots` does.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` after the request's computed ones; False if it can't.

        `computed_blocks` are prefix-cache hits for a request being admitted. On False nothing
        changed but the release of blocks out of the window (which happens either way). Blocks
        that become full in this step are registered in the prefix cache now: the
        runner writes every K/V of a step before any attention reads, so a request admitted later
        in the same step may already share them.
        """
        computed_blocks = computed_blocks or []
        owned = self.req_to_blocks.get(request.request_id, [])
        if self.sliding_window is not None:
            self._free_out_of_window(request, owned)
        num_total = request.num_computed_tokens + num_new_tokens
        num_required = self.blocks_needed(num_total) - len(owned) - len(computed_blocks)
        # Hits sitting in the free queue stop being free once referenced.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_required > self.num_free_blocks - num_free_hits:
            return False
        for block in computed_blocks:
            self._touch(block)
        owned = self.req_to_blocks.setdefault(request.request_id, owned)
        owned.extend(computed_blocks)
        if self.sliding_window is not None and computed_blocks:
            self._free_out_of_window(request, owned)  # hits before the window: not kept
        owned.extend(self._pop_free() for _ in range(max(num_required, 0)))
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, owned, num_total)
        return True

    def free(self, request: Request, num_written_tokens: int | None = None) -> None:
        """Drop the request's references; tail blocks first so they are evicted first.

        `num_written_tokens`: how many of the request's tokens have their K/V in the cache, when
        the blocks past them were allocated for a step that will not run for this request (it
        was preempted after being scheduled). Full blocks among those were offered to the prefix
        cache at allocation, but their K/V will never be written: the offer is withdrawn. They
        are the request's own (a prefix hit never lies past the written tokens).
        """
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_windowed_out.pop(request.request_id, None)
        owned = self.req_to_blocks.pop(request.request_id, [])
        if num_written_tokens is not None:
            for block in owned[num_written_tokens // self.block_size :]:
                if block is None:
                    continue
                if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
        for block in reversed(owned):
            if block is not None:
                self._release(block)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table; 0 in the places of blocks freed out of the window."""
        return [0 if b is None else b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request references now (its table less the entries freed)."""
        return sum(b is not None for b in self.req_to_blocks.get(request_id, []))

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is exact (used by tests)."""
        refs = [0] * self.num_blocks
        for request_id, owned in self.req_to_blocks.items():
            num_out = self.num_windowed_out.get(request_id, 0)
            assert all(b is None for b in owned[:num_out]), "window-freed entries"
            for block in owned[num_out:]:
                assert block is not None, "a None entry past the window-freed ones"
                refs[block.block_id] += 1
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], f"block {block.block_id} ref_cnt"
            free = block.block_id in self.free_queue or block.block_id >= self.next_fresh
            assert (block.ref_cnt == 0) == free, "free queue"
            assert block.block_id < self.next_fresh or block.block_hash is None, "fresh block"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, "cache map"

    def _release(self, block: KVBlock) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block.block_id] = block
            if block.block_hash is None:  # no prefix to keep: reused first
                self.free_queue.move_to_end(block.block_id, last=False)

    def _free_out_of_window(self, request: Request, owned: list[KVBlock | None]) -> None:
        """Release the request's blocks wholly before the window of its next computed token.

        That token, at position num_computed_tokens, sees positions > it - sliding_window, and
        every later token sees no earlier one. E.g. window 8, block size 4, next token at 13:
        positions <= 5 are out, so block 0 (positions 0-3) goes; block 1 (4-7) stays.
        """
        lowest_seen = request.num_computed_tokens - self.sliding_window + 1
        num_out = min(max(lowest_seen, 0) // self.block_size, len(owned))
        start = self.num_windowed_out.get(request.request_id, 0)
        if num_out <= start:
            return
        self.num_windowed_out[request.request_id] = num_out
        for i in range(start, num_out):
            block, owned[i] = owned[i], None
            self._release(block)

    def _touch(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def _keeps_free_queue(self) -> bool:
        """Whether the next allocation leaves the free queue alone: it is empty, or within the
        reserve with a cached prefix at its evicting end."""
        queue = self.free_queue
        if not queue:
            return True
        oldest = next(iter(queue.values()))
        return len(queue) <= self.cache_reserve and oldest.block_hash is not None

    def _pop_free(self) -> KVBlock:
        if self.next_fresh < self.num_blocks and self._keeps_free_queue():
            block = self.blocks[self.next_fresh]
            self.next_fresh += 1
            block.ref_cnt = 1
            return block
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def _cache_full_blocks(self, request: Request, owned: list[KVBlock], num_tokens: int) -> None:
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        self.num_cached_blocks[request.request_id] = max(start, num_full)
        for i in range(start, num_full):
            block = owned[i]
            if block is None or block.block_hash is not None:
                continue
            block_hash = request.block_hashes[i]
            if block_hash in self.cached:
                continue  # another block already holds this content; this one stays private
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            # A request's first block hangs off its LoRA adapter's root (None: the base
            # model's), so blocks computed under an adapter are shared with no other.
            parent = hashes[-1] if hashes else _root_hash(request)
            hashes.append(hash_block(parent, tokens[start : start + bs]))
