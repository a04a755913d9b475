"""The model manager: which versions are loaded, which take traffic, and how that changes.

It is the server's `ModelRouter` (model [+ version] → served version, split by traffic weights,
sticky per user) and `ModelControl` (load / unload / traffic, for the management API), over a
model repository read by `scan.scan_repository`.

Control modes (Triton's): `none` loads every model at start and never changes; `poll` also
rescans every `poll_interval` seconds (new, removed and replaced versions, changed configs);
`explicit` loads only what the management API (or `startup_models`) asks for.

Invariants:
- a version takes traffic only once it is fully loaded and started (READY);
- a version that fails to load is UNAVAILABLE with its error, and the others keep serving;
- a version leaving (unloaded, removed or replaced) stops taking new requests at once, finishes
  the ones it holds, then is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from qiao.errors import ConfigError, EngineUnavailableError, ModelNotFoundError, QiaoError
from qiao.repository.scan import (
    MAX_VERSION_LENGTH,
    ModelEntry,
    VersionDir,
    Warn,
    check_model_name,
    quoted,
    scan_repository,
)
from qiao.repository.types import ServedVersion, VersionState, VersionStatus

logger = logging.getLogger("qiao.repository")

ControlMode = str  # "none" | "poll" | "explicit"
CONTROL_MODES = ("none", "poll", "explicit")


class Served(ServedVersion, Protocol):
    """A served version as the manager drives it."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def num_unfinished(self) -> int: ...

    def is_healthy(self) -> tuple[bool, str]: ...


# Builds (blocking, in a worker thread) one version of a model from its folder and config.
VersionLoader = Callable[[ModelEntry, VersionDir], Served]
# Reads the repository (blocking, in a worker thread): every model by name, as
# `scan.scan_repository` does for a local folder; messages go to `warn`.
RepositoryScan = Callable[[Warn], dict[str, ModelEntry]]


@dataclass
class _Slot:
    version: str
    state: VersionState
    reason: str = ""
    served: Served | None = None
    fingerprint: str = ""


@dataclass
class _Model:
    name: str
    entry: ModelEntry | None = None
    slots: dict[str, _Slot] = field(default_factory=dict)
    # Traffic weights by version; None = all traffic to the newest ready version.
    weights: dict[str, float] | None = None
    error: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Smooth weighted round-robin state for requests without a user (reset on a new split).
    credit: dict[str, float] = field(default_factory=dict)

    def ready(self) -> list[str]:
        return sorted(
            (v for v, s in self.slots.items() if s.state is VersionState.READY),
            key=int,
        )


class ModelManager:
    def __init__(
        self,
        loader: VersionLoader | None = None,
        root: Path | None = None,
        *,
        mode: ControlMode = "none",
        poll_interval: float = 5.0,
        startup_models: Iterable[str] = (),
        drain_timeout: float = 30.0,
        on_ready: Callable[[Served], None] | None = None,
        scan: RepositoryScan | None = None,
        on_stopped: Callable[[Served], None] | None = None,
    ) -> None:
        """`root`: the repository folder, or for a repository elsewhere (`scan` given) the
        local folder its versions load from (errors show paths relative to it). `on_stopped`
        is called once a version the loader built has stopped."""
        if mode not in CONTROL_MODES:
            raise ConfigError(f"model_control_mode must be one of {', '.join(CONTROL_MODES)}")
        self.loader = loader
        self.root = root.resolve() if root is not None else None
        self.mode = mode
        self.poll_interval = poll_interval
        self.startup_models = list(startup_models)
        self.drain_timeout = drain_timeout
        self.on_ready = on_ready
        self.on_stopped = on_stopped
        self._scan_repository = scan
        self.draining = False
        self._models: dict[str, _Model] = {}
        self._poll_task: asyncio.Task[None] | None = None
        self._warned: set[str] = set()
        # Replaced instances finishing their requests: no longer in a slot, still serving.
        self._leaving: list[Served] = []

    @classmethod
    def static(cls, versions: Iterable[Served], **kwargs: Any) -> ModelManager:
        """Already-built versions, started with the server, never reloaded (no repository):
        `qiao serve --model PATH`, and the built-in models."""
        manager = cls(**kwargs)
        for served in versions:
            slot = _Slot(served.version, VersionState.LOADING, served=served)
            model = manager._models.setdefault(served.model, _Model(served.model))
            model.slots[served.version] = slot
        return manager

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start prebuilt versions, load the repository per the control mode, start polling."""
        for model in self._models.values():
            for slot in model.slots.values():
                if slot.served is not None and slot.state is VersionState.LOADING:
                    slot.served.start()
                    slot.state = VersionState.READY
                    if self.on_ready is not None:
                        self.on_ready(slot.served)
        if self.root is None:
            return
        if self.mode in ("none", "poll"):
            await self.rescan()
        else:
            for name in self.startup_models:
                await self.load(name)
        if self.mode == "poll":
            self._poll_task = asyncio.create_task(self._poll(), name="qiao-repository-poll")

    async def shutdown(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
        for model in list(self._models.values()):
            for slot in list(model.slots.values()):
                if slot.served is not None:
                    await self._stop(slot.served)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.rescan()
            except Exception:  # keep polling: one bad scan must not stop hot reload
                logger.exception("repository rescan failed")

    # --- ModelRouter -----------------------------------------------------------------------

    def is_ready(self) -> bool:
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        """Why the server is not ready (None: it is): draining, a model still loading its first
        version, or an engine that stopped making progress. A model whose versions all failed
        to load does not hold the others back: it is reported in the index."""
        if self.draining:
            return "draining"
        for model in self._models.values():
            states = [slot.state for slot in model.slots.values()]
            if VersionState.LOADING in states and VersionState.READY not in states:
                return f"model {model.name!r} is loading"
            for slot in model.slots.values():
                if slot.state is VersionState.READY and slot.served is not None:
                    healthy, reason = slot.served.is_healthy()
                    if not healthy:
                        return f"model {model.name!r}: {reason}"
        return None

    def model_names(self) -> list[str]:
        return sorted(name for name, m in self._models.items() if m.ready())

    def ready_versions(self, model: str) -> list[str]:
        m = self._models.get(model)
        return m.ready() if m is not None else []

    def get(self, model: str, version: str | None = None, *, user: str | None = None) -> Served:
        m = self._models.get(model)
        if m is None or not m.slots:
            raise ModelNotFoundError(
                f"model {quoted(model)} is not served; GET /v1/models lists them"
            )
        if self.draining:
            raise EngineUnavailableError("the server is shutting down; retry on another replica")
        if version is not None:
            slot = m.slots.get(version)
            if slot is None:
                raise ModelNotFoundError(f"model {model!r} has no version {quoted(version)}")
            if slot.state is not VersionState.READY or slot.served is None:
                raise EngineUnavailableError(f"version {version} of model {model!r} is not ready")
            return slot.served
        ready = m.ready()
        if not ready:
            raise EngineUnavailableError(f"model {model!r} has no ready version")
        chosen = _split(m, ready, user)
        served = m.slots[chosen].served
        assert served is not None
        return served

    def served_versions(self) -> list[Served]:
        """Every started version (ready or leaving), for metrics and draining."""
        out = []
        for model in self._models.values():
            out += [s.served for s in model.slots.values() if s.served is not None]
        return out

    def num_unfinished(self) -> int:
        """Requests held by every started version, replaced instances still finishing theirs
        included (they are not in `served_versions`: their labels are the new instance's)."""
        served = self.served_versions()
        served += [s for s in self._leaving if s not in served]
        return sum(s.num_unfinished() for s in served)

    def traffic(self, model: str) -> dict[str, float]:
        """The effective split over ready versions (shares summing to 1)."""
        m = self._models.get(model)
        if m is None:
            return {}
        ready = m.ready()
        weights = _effective_weights(ready, m.weights)
        total = sum(weights.values())
        return {v: w / total for v, w in weights.items()} if total else {}

    # --- ModelControl ----------------------------------------------------------------------

    def index(self) -> list[VersionStatus]:
        rows = []
        for name in sorted(self._models):
            m = self._models[name]
            if m.error:
                rows.append(VersionStatus(name, "", VersionState.UNAVAILABLE, m.error))
            for version in sorted(m.slots, key=int):
                slot = m.slots[version]
                rows.append(
                    VersionStatus(name, version, slot.state, slot.reason, _breaker(slot.served))
                )
        return rows

    async def load(self, model: str) -> None:
        if self.mode == "none":
            raise ConfigError(
                "model_control_mode is 'none': models load at start only; restart with "
                "--model-control-mode explicit (or poll) to load and unload at run time"
            )
        check_model_name(model)
        entry = await asyncio.to_thread(self._scan_one, model)
        if entry is None:
            raise ModelNotFoundError(f"model {model!r} is not in the repository")
        await self._reconcile(model, entry, force=True)
        if entry.error:  # reported in the index too; loaded versions keep serving
            raise ConfigError(self._clean(entry.error))

    async def unload(self, model: str) -> None:
        if self.mode != "explicit":
            raise ConfigError(
                f"model_control_mode is {self.mode!r}: unload needs --model-control-mode "
                "explicit (in poll mode, remove the model's folder instead)"
            )
        check_model_name(model)
        if model not in self._models:
            raise ModelNotFoundError(f"model {model!r} is not loaded")
        await self._reconcile(model, None)

    def set_traffic(self, model: str, weights: dict[str, float]) -> None:
        m = self._models.get(model)
        if m is None:
            raise ModelNotFoundError(f"model {model!r} is not loaded")
        checked = _check_weights(weights)
        ready = set(m.ready())
        missing = sorted(set(checked) - ready, key=int)
        if missing:
            raise ConfigError(
                f"traffic: version(s) {', '.join(missing)} of model {model!r} are not ready "
                f"(ready: {', '.join(sorted(ready, key=int)) or 'none'})"
            )
        if not any(checked[v] > 0 for v in checked):
            raise ConfigError("traffic: at least one weight must be > 0")
        m.weights = checked
        m.credit.clear()
        logger.info("traffic of %s: %s", model, self.traffic(model))

    # --- reconciling the repository ----------------------------------------------------------

    def _scan(self) -> dict[str, ModelEntry]:
        assert self.root is not None
        if self._scan_repository is not None:
            return self._scan_repository(self._warn_once)
        return scan_repository(self.root, warn=self._warn_once)

    def _warn_once(self, message: str) -> None:
        # Polling rescans every few seconds: say each skipped entry once, not on every scan.
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)

    def _scan_one(self, model: str) -> ModelEntry | None:
        if self.root is None:
            return None
        return self._scan().get(model)

    async def rescan(self) -> None:
        """Bring the loaded models in line with the repository (modes none and poll)."""
        entries = await asyncio.to_thread(self._scan)
        for name in sorted(set(entries) | set(self._models)):
            if self.root is None:
                break
            await self._reconcile(name, entries.get(name))

    async def _reconcile(self, name: str, entry: ModelEntry | None, force: bool = False) -> None:
        async with self._locked(name) as m:
            if entry is None:
                for version in list(m.slots):
                    await self._remove(m, version)
                self._models.pop(name, None)
                return
            if entry.error:
                # A broken config is reported; whatever was loaded keeps serving.
                m.error = self._clean(entry.error)
                return
            m.error = ""
            assert entry.config is not None
            old = m.entry
            config_changed = old is not None and _config_key(old) != _config_key(entry)
            if old is None or _traffic_key(old) != _traffic_key(entry):
                m.weights = _initial_weights(entry)
                m.credit.clear()
            m.entry = entry
            wanted = entry.versions
            # New and replaced versions first, so the old ones serve while they load.
            for version in sorted(wanted, key=int):
                vdir = wanted[version]
                slot = m.slots.get(version)
                if slot is None:
                    await self._add(m, entry, vdir)
                elif force or config_changed or slot.fingerprint != vdir.fingerprint:
                    if slot.state is VersionState.UNAVAILABLE or slot.served is None:
                        m.slots.pop(version)
                        await self._add(m, entry, vdir)
                    else:
                        await self._replace(m, entry, vdir)
            leaving = [v for v in m.slots if v not in wanted]
            if leaving and not any(
                m.slots[v].state is VersionState.READY for v in wanted if v in m.slots
            ):
                # No wanted version is ready (e.g. the new latest failed): keep what serves.
                logger.warning(
                    "%s: no version the policy selects is ready; keeping version(s) %s",
                    name,
                    ", ".join(sorted(leaving, key=int)),
                )
                leaving = [v for v in leaving if m.slots[v].state is not VersionState.READY]
            for version in leaving:
                await self._remove(m, version)

    @contextlib.asynccontextmanager
    async def _locked(self, name: str) -> AsyncIterator[_Model]:
        """The model's record, locked. A removal drops the record while others may wait on its
        lock (e.g. load, unload, load): they start over on the current record, so nothing is
        loaded into one no longer routed to."""
        while True:
            m = self._models.setdefault(name, _Model(name))
            await m.lock.acquire()
            if self._models.get(name) is m:
                break
            m.lock.release()
        try:
            yield m
        finally:
            m.lock.release()

    async def _build(self, entry: ModelEntry, vdir: VersionDir) -> Served:
        if vdir.error:
            raise QiaoError(vdir.error)
        assert self.loader is not None
        served = await asyncio.to_thread(self.loader, entry, vdir)
        served.start()
        return served

    async def _add(self, m: _Model, entry: ModelEntry, vdir: VersionDir) -> None:
        slot = _Slot(vdir.version, VersionState.LOADING, fingerprint=vdir.fingerprint)
        m.slots[vdir.version] = slot
        logger.info("loading %s version %s", m.name, vdir.version)
        started = time.monotonic()
        try:
            slot.served = await self._build(entry, vdir)
        except Exception as exc:
            slot.state, slot.reason = VersionState.UNAVAILABLE, self._clean(_describe(exc))
            if _retry_on_rescan(exc):
                slot.fingerprint = ""  # differs from any scan's: the next rescan retries
            logger.error("%s version %s failed to load: %s", m.name, vdir.version, slot.reason)
            return
        slot.state = VersionState.READY
        if self.on_ready is not None:
            self.on_ready(slot.served)
        logger.info(
            "%s version %s ready in %.1f s", m.name, vdir.version, time.monotonic() - started
        )

    async def _replace(self, m: _Model, entry: ModelEntry, vdir: VersionDir) -> None:
        """Load the new files beside the old instance; swap only once the new one is ready."""
        slot = m.slots[vdir.version]
        logger.info("reloading %s version %s", m.name, vdir.version)
        try:
            served = await self._build(entry, vdir)
        except Exception as exc:
            # The old instance keeps serving; the failure is reported on the version.
            slot.reason = "reload failed, previous files still serving: " + self._clean(
                _describe(exc)
            )
            slot.fingerprint = "" if _retry_on_rescan(exc) else vdir.fingerprint
            logger.error("%s version %s: %s", m.name, vdir.version, slot.reason)
            return
        old, slot.served = slot.served, served
        slot.state, slot.reason, slot.fingerprint = VersionState.READY, "", vdir.fingerprint
        if self.on_ready is not None:
            self.on_ready(served)
        if old is not None:
            await self._retire(old)

    async def _remove(self, m: _Model, version: str) -> None:
        slot = m.slots.get(version)
        if slot is None:
            return
        slot.state = VersionState.UNLOADING
        if m.weights is not None and version in m.weights:
            m.weights = {v: w for v, w in m.weights.items() if v != version} or None
        try:
            if slot.served is not None:
                await self._retire(slot.served)
        finally:
            # Stopped by now even if cancelled; a slot left behind would be stopped twice.
            m.slots.pop(version, None)
        logger.info("unloaded %s version %s", m.name, version)

    async def _retire(self, served: Served) -> None:
        """Wait for the requests `served` holds (up to drain_timeout), then stop it."""
        deadline = time.monotonic() + self.drain_timeout
        self._leaving.append(served)
        try:
            # New requests no longer reach it; yield once so ones already routed get admitted.
            await asyncio.sleep(0)
            while served.num_unfinished() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            # Also when cancelled (shutdown cancels the poll loop mid-drain): never leak it.
            self._leaving.remove(served)
            await self._stop(served)

    async def _stop(self, served: Served) -> None:
        try:
            await served.stop()
        finally:
            if self.on_stopped is not None:
                self.on_stopped(served)

    def _clean(self, message: str) -> str:
        """An error for the index: repository paths shown relative to the repository."""
        if self.root is not None:
            message = message.replace(str(self.root) + "/", "")
        return message


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, QiaoError) else f"{type(exc).__name__}: {text}"


def _retry_on_rescan(exc: BaseException) -> bool:
    """Whether a failed load is retried at the next rescan even if nothing changed (a remote
    version's copy that failed half-way); other failures wait for a change or a `load`."""
    return bool(getattr(exc, "retry_on_rescan", False))


def _config_key(entry: ModelEntry) -> Any:
    """The config without its traffic weights: a change here reloads every version."""
    assert entry.config is not None
    return entry.config.model_dump(exclude={"traffic"})


def _traffic_key(entry: ModelEntry) -> Any:
    assert entry.config is not None
    return entry.config.traffic


def _initial_weights(entry: ModelEntry) -> dict[str, float] | None:
    assert entry.config is not None
    traffic = entry.config.traffic
    if not traffic:
        return None
    return {str(v): float(w) for v, w in traffic.items()}


def _breaker(served: Served | None) -> str | None:
    """The circuit breaker state of a served version (None for one without)."""
    breaker = getattr(served, "breaker", None)
    return None if breaker is None else breaker.state.label


def _check_weights(weights: dict[str, float]) -> dict[str, float]:
    checked = {}
    for version, weight in weights.items():
        v = str(version)
        if not v.isdigit() or not v.isascii() or len(v.lstrip("0")) > MAX_VERSION_LENGTH:
            raise ConfigError(
                f"traffic: version {quoted(v)} must be a number of at most "
                f"{MAX_VERSION_LENGTH} digits"
            )
        try:
            w = float(weight)
        except (TypeError, ValueError):
            raise ConfigError(f"traffic: weight of version {v} must be a number") from None
        if not (w >= 0 and w != float("inf")):
            raise ConfigError(f"traffic: weight of version {v} must be >= 0 and finite")
        checked[v.lstrip("0") or "0"] = w
    return checked


def _effective_weights(ready: list[str], weights: dict[str, float] | None) -> dict[str, float]:
    """Weights over ready versions; without any (or none ready), the newest ready one."""
    if weights:
        live = {v: w for v, w in weights.items() if v in ready and w > 0}
        if live:
            return live
    return {ready[-1]: 1.0} if ready else {}


def _split(m: _Model, ready: list[str], user: str | None) -> str:
    """The version for one request. With a `user`: a hash of it, so the same user stays on the
    same version while the weights stay the same. Without: smooth weighted round-robin, so any
    window of requests splits as close to the weights as whole requests allow (90 / 10 gives
    exactly 9 and 1 of every 10), with no clustering."""
    live = _effective_weights(ready, m.weights)
    if len(live) == 1:
        return next(iter(live))
    total = sum(live.values())
    if user:
        digest = hashlib.sha256(f"{m.name}\0{user}".encode()).digest()
        point = int.from_bytes(digest[:8], "big") / 2**64 * total
        for version in sorted(live, key=int):
            point -= live[version]
            if point < 0:
                return version
        return max(live, key=int)
    credit = m.credit
    for version in [v for v in credit if v not in live]:
        del credit[version]
    for version, weight in live.items():
        credit[version] = credit.get(version, 0.0) + weight
    chosen = max(sorted(live, key=int), key=lambda v: credit[v])
    credit[chosen] -= total
    return chosen
