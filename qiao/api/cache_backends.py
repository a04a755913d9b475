"""Where the response cache keeps its entries: `MemoryBackend` (this process, an LRU bounded by
bytes and entries, with a TTL) and `RedisBackend` (a Redis server shared by replicas).

A backend stores opaque `CachedResponse`s under a key, in a group (the model version that made
them, `(model, version)`), so a reload or an unload drops a version's entries at once. What
bounds what: the memory backend holds at most `max_entries` entries and `max_bytes` bytes of
bodies (least recently used go first, each eviction counted); Redis entries expire by their
TTL (`SET ... EX`) and the server's `maxmemory` with `maxmemory-policy allkeys-lru` bounds the
bytes of all replicas together. An entry larger than `max_bytes` is never stored in either.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

Group = tuple[str, str]  # (model, version)

# Per entry, what the memory backend counts beside the body: key, headers, bookkeeping.
ENTRY_OVERHEAD_BYTES = 256


@dataclass(frozen=True)
class CachedResponse:
    """A whole successful response: body bytes as sent, media type, and headers to repeat."""

    body: bytes
    media_type: str
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Bytes this entry counts against a bound."""
        extra = sum(len(k) + len(v) for k, v in self.headers.items())
        return len(self.body) + len(self.media_type) + extra + ENTRY_OVERHEAD_BYTES

    def encode(self) -> bytes:
        """One byte string: header length, a JSON header (media type, headers), the body."""
        head = json.dumps({"media_type": self.media_type, "headers": self.headers}).encode()
        return struct.pack("<I", len(head)) + head + self.body

    @classmethod
    def decode(cls, data: bytes) -> CachedResponse:
        (length,) = struct.unpack_from("<I", data)
        head = json.loads(data[4 : 4 + length])
        return cls(data[4 + length :], head["media_type"], dict(head["headers"]))


class CacheBackend(Protocol):
    async def get(self, key: str, group: Group) -> CachedResponse | None: ...

    async def put(self, key: str, group: Group, value: CachedResponse, ttl: float) -> None: ...

    async def drop_group(self, group: Group) -> int:
        """Remove every entry of `group`; returns how many (where known)."""
        ...

    def usage(self) -> dict[str, tuple[int, int]]:
        """model → (bytes, entries) held here; {} where the backend does not know."""
        ...

    async def close(self) -> None: ...


@dataclass
class _Entry:
    value: CachedResponse
    group: Group
    expires: float


class MemoryBackend:
    """An LRU of entries in this process, bounded by `max_bytes` and `max_entries`, each entry
    expiring `ttl` seconds after it was stored. Safe from the event loop and from threads (one
    lock; every operation is a few dictionary steps). `on_evict(model)` is called once per entry
    evicted to keep a bound (expired and dropped entries are not evictions)."""

    def __init__(
        self,
        max_bytes: int,
        max_entries: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.clock = clock
        self.on_evict = on_evict
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._groups: dict[Group, set[str]] = {}
        self._bytes: dict[str, int] = {}  # per model
        self._counts: dict[str, int] = {}  # per model
        self._total = 0
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str, group: Group) -> CachedResponse | None:
        return self.get_now(key)

    def get_now(self, key: str) -> CachedResponse | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.expires <= self.clock():
                self._remove(key)
                return None
            self._entries.move_to_end(key)
            return entry.value

    async def put(self, key: str, group: Group, value: CachedResponse, ttl: float) -> None:
        self.put_now(key, group, value, ttl)

    def put_now(self, key: str, group: Group, value: CachedResponse, ttl: float) -> None:
        size = value.size
        if size > self.max_bytes or self.max_entries < 1:
            return
        evicted: list[str] = []
        with self._lock:
            if key in self._entries:
                self._remove(key)
            self._entries[key] = _Entry(value, group, self.clock() + ttl)
            self._groups.setdefault(group, set()).add(key)
            self._add_bytes(group[0], size)
            while len(self._entries) > self.max_entries or self._total > self.max_bytes:
                oldest = next(iter(self._entries))
                evicted.append(self._entries[oldest].group[0])
                self._remove(oldest)
        if self.on_evict is not None:
            for model in evicted:
                self.on_evict(model)

    async def drop_group(self, group: Group) -> int:
        return self.drop_group_now(group)

    def drop_group_now(self, group: Group) -> int:
        with self._lock:
            keys = list(self._groups.get(group, ()))
            for key in keys:
                self._remove(key)
            return len(keys)

    def usage(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            return {model: (self._bytes[model], n) for model, n in self._counts.items()}

    async def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._groups.clear()
            self._bytes.clear()
            self._counts.clear()
            self._total = 0

    def _add_bytes(self, model: str, size: int) -> None:
        """Count one entry of `size` bytes in (size > 0) or out (size < 0)."""
        self._bytes[model] = self._bytes.get(model, 0) + size
        self._counts[model] = self._counts.get(model, 0) + (1 if size > 0 else -1)
        self._total += size
        if not self._counts[model]:
            del self._counts[model], self._bytes[model]

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        keys = self._groups.get(entry.group)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._groups[entry.group]
        self._add_bytes(entry.group[0], -entry.value.size)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisBackend:
    """Entries in a Redis server (`redis://HOST:PORT/DB`), shared by every replica that names
    it: `<namespace>:<model>:<version>:<digest>` → the encoded response, with `SET ... EX ttl`.
    Dropping a version's group deletes its keys for every replica (SCAN + DEL); the version's
    fingerprint in the digest already makes another build's entries unreachable."""

    def __init__(self, url: str, namespace: str, max_bytes: int) -> None:
        try:
            import redis.asyncio as redis_asyncio
        except ImportError as exc:  # the `redis` extra
            from qiao.errors import ConfigError

            raise ConfigError(
                "response-cache-backend redis://... needs the redis client: "
                "pip install 'qiao[redis]'"
            ) from exc
        self.url = url
        self.namespace = namespace
        self.max_bytes = max_bytes
        self._client: Any = redis_asyncio.from_url(
            url, socket_timeout=2.0, socket_connect_timeout=2.0
        )

    def _prefix(self, group: Group) -> str:
        return f"{self.namespace}:{group[0]}:{group[1]}:"

    def full_key(self, key: str, group: Group) -> str:
        return self._prefix(group) + key

    async def get(self, key: str, group: Group) -> CachedResponse | None:
        data = await self._client.get(self.full_key(key, group))
        return CachedResponse.decode(data) if data is not None else None

    async def put(self, key: str, group: Group, value: CachedResponse, ttl: float) -> None:
        if value.size > self.max_bytes:
            return
        await self._client.set(
            self.full_key(key, group), value.encode(), px=max(int(ttl * 1000), 1)
        )

    async def drop_group(self, group: Group) -> int:
        pattern = _glob_escape(self._prefix(group)) + "*"
        dropped = 0
        async for name in self._client.scan_iter(match=pattern, count=500):
            dropped += await self._client.delete(name)
        return dropped

    def usage(self) -> dict[str, tuple[int, int]]:
        return {}

    async def close(self) -> None:
        await self._client.aclose()
