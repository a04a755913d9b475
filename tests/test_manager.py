"""The model manager on its own: control modes, hot reload, routing and canary splits, the
index and readiness, driven over a real repository on disk (tiny config files, fake version
folders) with a fake loader whose versions can fail to load, block while loading, or hold
requests in flight.

Each test runs one event loop (`run`); waits are on conditions, never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qiao.errors import ConfigError, EngineUnavailableError, ModelLoadError, ModelNotFoundError
from qiao.repository.manager import ModelManager
from qiao.repository.scan import ModelEntry, VersionDir
from qiao.repository.types import TensorSpec, VersionState, VersionStatus

TIMEOUT_S = 10.0  # per test; every wait below is bounded by it
ALL_VERSIONS = "backend: embedding\nversion_policy: all\n"
READY, LOADING = VersionState.READY, VersionState.LOADING
UNLOADING, UNAVAILABLE = VersionState.UNLOADING, VersionState.UNAVAILABLE


# --- fakes -------------------------------------------------------------------------------------


class FakeVersion:
    """A served version that records how the manager drives it. Requests wait on `gate`
    (open by default), so a test can hold them in flight."""

    backend = "embedding"
    platform = "fake"
    inputs = (TensorSpec("x", "FP32", (-1,)),)
    outputs = (TensorSpec("version", "INT64", (-1,)),)

    def __init__(self, model: str, version: str, entry: ModelEntry) -> None:
        self.model = model
        self.version = version
        self.entry = entry
        self.num_starts = 0
        self.num_stops = 0
        self.num_in_flight = 0
        self.num_polls = 0  # calls of num_unfinished(): a draining manager polls it
        self.health = (True, "ok")
        self.gate = asyncio.Event()
        self.gate.set()

    def start(self) -> None:
        self.num_starts += 1

    async def stop(self) -> None:
        self.num_stops += 1

    def num_unfinished(self) -> int:
        self.num_polls += 1
        return self.num_in_flight

    def is_healthy(self) -> tuple[bool, str]:
        return self.health

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        *,
        priority: int | None = None,
        timeout_us: int | None = None,
    ) -> dict[str, np.ndarray]:
        self.num_in_flight += 1
        try:
            await self.gate.wait()
            return {"version": np.array([int(self.version)])}
        finally:
            self.num_in_flight -= 1


class Block:
    """A loader call held until `release` is set; `entered` is set once the call waits."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()


class FakeLoader:
    """A `VersionLoader` building FakeVersions; it can fail or block a (model, version)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.built: list[FakeVersion] = []
        self.failures: dict[tuple[str, str], str] = {}
        self.blocks: dict[tuple[str, str], Block] = {}

    def fail(self, model: str, version: str, message: str) -> None:
        self.failures[(model, version)] = message

    def block(self, model: str, version: str) -> Block:
        self.blocks[(model, version)] = Block()
        return self.blocks[(model, version)]

    def __call__(self, entry: ModelEntry, vdir: VersionDir) -> FakeVersion:
        key = (entry.name, vdir.version)
        self.calls.append(key)
        block = self.blocks.pop(key, None)
        if block is not None:
            block.entered.set()
            # Bounded, so a failing test cannot hang the worker thread (and asyncio.run) forever.
            if not block.release.wait(TIMEOUT_S):
                raise TimeoutError("test never released the loader")
        if key in self.failures:
            raise ModelLoadError(f"{vdir.path}: {self.failures[key]}")
        served = FakeVersion(entry.name, vdir.version, entry)
        self.built.append(served)
        return served

    def instances(self, model: str, version: str) -> list[FakeVersion]:
        return [s for s in self.built if (s.model, s.version) == (model, version)]


class Repo:
    """A model repository on disk: config files and minimal HF version folders."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self._edits = 0

    def model(self, name: str, *versions: int, config: str = ALL_VERSIONS) -> None:
        self.config(name, config)
        for version in versions:
            self.add(name, version)

    def config(self, name: str, text: str) -> None:
        (self.root / name).mkdir(exist_ok=True)
        (self.root / name / "config.yaml").write_text(text)

    def add(self, name: str, version: int) -> None:
        folder = self.root / name / str(version)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"model_type": "bert"}')
        (folder / "model.safetensors").write_text("weights")

    def replace(self, name: str, version: int) -> None:
        """New weights in the folder: a longer file, so the fingerprint surely changes."""
        self._edits += 1
        path = self.root / name / str(version) / "model.safetensors"
        path.write_text("weights" + "!" * self._edits)

    def remove(self, name: str, version: int | None = None) -> None:
        shutil.rmtree(self.root / name / (str(version) if version is not None else ""))


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return Repo(tmp_path / "models")


@pytest.fixture
def loader() -> FakeLoader:
    return FakeLoader()


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def until(condition: Callable[[], bool], what: str) -> None:
    """Yield to the loop (and the loader's threads) until `condition()` holds."""
    deadline = time.monotonic() + TIMEOUT_S / 2
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.001)


def states(manager: ModelManager, model: str) -> dict[str, VersionState]:
    return {s.version: s.state for s in manager.index() if s.model == model}


def row(manager: ModelManager, model: str, version: str) -> VersionStatus:
    (found,) = [s for s in manager.index() if (s.model, s.version) == (model, version)]
    return found


def split(manager: ModelManager, model: str, n: int, user: str | None = None) -> Counter[str]:
    return Counter(manager.get(model, user=user).version for _ in range(n))


# --- control modes -----------------------------------------------------------------------------


def test_unknown_control_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="model_control_mode"):
        ModelManager(mode="sometimes")


def test_none_mode_loads_everything_at_start_and_refuses_load_and_unload(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1, 2)
    repo.model("chat", 3)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="none")
        await manager.start()
        assert sorted(loader.calls) == [("chat", "3"), ("embed", "1"), ("embed", "2")]
        assert all(s.num_starts == 1 for s in loader.built)
        assert manager.index() == [
            VersionStatus("chat", "3", READY),
            VersionStatus("embed", "1", READY),
            VersionStatus("embed", "2", READY),
        ]
        for call in (manager.load, manager.unload):
            with pytest.raises(ConfigError, match="explicit"):
                await call("embed")
        assert len(loader.calls) == 3 and not any(s.num_stops for s in loader.built)
        await manager.shutdown()

    run(scenario())


def test_explicit_mode_loads_startup_models_then_what_it_is_asked(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)
    repo.model("chat", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="explicit", startup_models=["embed"])
        await manager.start()
        assert loader.calls == [("embed", "1")]
        assert manager.model_names() == ["embed"]
        with pytest.raises(ModelNotFoundError):
            manager.get("chat")

        await manager.load("chat")
        assert manager.model_names() == ["chat", "embed"]
        chat = manager.get("chat")
        assert (chat.model, chat.version) == ("chat", "1")

        await manager.unload("chat")
        assert loader.instances("chat", "1")[0].num_stops == 1
        assert manager.model_names() == ["embed"]
        assert [s.model for s in manager.index()] == ["embed"]
        with pytest.raises(ModelNotFoundError):
            manager.get("chat")
        with pytest.raises(ModelNotFoundError, match="not loaded"):
            await manager.unload("chat")
        await manager.shutdown()

    run(scenario())


@pytest.mark.parametrize("name", ["../embed", "embed/1", "", ".hidden", "a b", "emb\x00ed"])
def test_explicit_mode_checks_names(repo: Repo, loader: FakeLoader, name: str) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="explicit")
        await manager.start()
        for call in (manager.load, manager.unload):
            with pytest.raises(ConfigError, match="model name"):
                await call(name)
        with pytest.raises(ModelNotFoundError, match="not in the repository"):
            await manager.load("missing")
        assert loader.calls == [] and manager.index() == []
        await manager.shutdown()

    run(scenario())


def test_explicit_load_of_a_loaded_model_reloads_it(repo: Repo, loader: FakeLoader) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="explicit", startup_models=["embed"])
        await manager.start()
        (old,) = loader.built
        await manager.load("embed")
        new = manager.get("embed")
        assert new is not old and loader.calls == [("embed", "1")] * 2
        assert (old.num_stops, new.num_stops) == (1, 0)
        await manager.shutdown()

    run(scenario())


def test_poll_rescan_picks_up_new_removed_and_replaced_versions(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        (v1,) = loader.built

        await manager.rescan()  # nothing changed: nothing reloads
        assert loader.calls == [("embed", "1")]

        repo.add("embed", 2)
        await manager.rescan()
        assert loader.calls[1:] == [("embed", "2")]
        assert manager.ready_versions("embed") == ["1", "2"]
        v2 = manager.get("embed", "2")

        repo.replace("embed", 1)
        await manager.rescan()
        assert loader.calls[2:] == [("embed", "1")]
        v1_new = manager.get("embed", "1")
        assert v1_new is not v1 and v1.num_stops == 1 and v1_new.num_stops == 0
        assert v2.num_stops == 0

        repo.remove("embed", 1)
        await manager.rescan()
        assert states(manager, "embed") == {"2": READY}
        assert v1_new.num_stops == 1
        with pytest.raises(ModelNotFoundError, match="no version '1'"):
            manager.get("embed", "1")

        repo.model("chat", 1)
        await manager.rescan()
        assert manager.model_names() == ["chat", "embed"]

        repo.remove("embed")
        await manager.rescan()
        assert manager.model_names() == ["chat"] and v2.num_stops == 1
        with pytest.raises(ModelNotFoundError):
            manager.get("embed")
        assert len(loader.calls) == 4
        await manager.shutdown()

    run(scenario())


def test_poll_timer_rescans_by_itself_and_stops_at_shutdown(repo: Repo, loader: FakeLoader) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=0.01)
        await manager.start()
        repo.add("embed", 2)
        await until(lambda: manager.ready_versions("embed") == ["1", "2"], "the poll loads v2")
        await manager.shutdown()
        assert manager._poll_task is not None and manager._poll_task.done()
        assert [s.num_stops for s in loader.built] == [1, 1]

    run(scenario())


# --- loading, failing, replacing ---------------------------------------------------------------


def test_a_version_takes_no_traffic_before_it_is_ready(repo: Repo, loader: FakeLoader) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        v1 = manager.get("embed")
        repo.add("embed", 2)
        block = loader.block("embed", "2")
        rescan = asyncio.create_task(manager.rescan())
        await until(block.entered.is_set, "the loader is building v2")

        assert states(manager, "embed") == {"1": READY, "2": LOADING}
        with pytest.raises(EngineUnavailableError, match="not ready"):
            manager.get("embed", "2")
        assert split(manager, "embed", 20) == {"1": 20}
        assert manager.ready_versions("embed") == ["1"]
        assert manager.not_ready_reason() is None  # v1 serves meanwhile

        block.release.set()
        await rescan
        v2 = manager.get("embed")
        assert v2.version == "2" and manager.get("embed", "1") is v1
        await manager.shutdown()

    run(scenario())


def test_the_old_instance_serves_while_its_replacement_loads(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        old = manager.get("embed")
        repo.replace("embed", 1)
        block = loader.block("embed", "1")
        rescan = asyncio.create_task(manager.rescan())
        await until(block.entered.is_set, "the loader is rebuilding v1")

        assert states(manager, "embed") == {"1": READY}
        assert manager.get("embed") is old and manager.get("embed", "1") is old
        assert old.num_stops == 0

        block.release.set()
        await rescan
        new = manager.get("embed", "1")
        assert new is not old and new.num_starts == 1 and old.num_stops == 1
        await manager.shutdown()

    run(scenario())


def test_first_load_makes_the_server_not_ready_until_done(repo: Repo, loader: FakeLoader) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="explicit")
        await manager.start()
        assert manager.is_ready()
        block = loader.block("embed", "1")
        load = asyncio.create_task(manager.load("embed"))
        await until(block.entered.is_set, "the loader is building v1")

        assert manager.not_ready_reason() == "model 'embed' is loading"
        assert not manager.is_ready()
        assert manager.model_names() == [] and manager.ready_versions("embed") == []
        with pytest.raises(EngineUnavailableError, match="no ready version"):
            manager.get("embed")

        block.release.set()
        await load
        assert manager.is_ready() and manager.model_names() == ["embed"]
        await manager.shutdown()

    run(scenario())


def test_a_failing_version_is_unavailable_and_the_previous_one_keeps_serving(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1, config=ALL_VERSIONS + 'traffic: {"1": 50, "2": 50}\n')

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        v1 = manager.get("embed")
        repo.add("embed", 2)
        loader.fail("embed", "2", "unsupported architecture BertPlus")
        await manager.rescan()

        reason = row(manager, "embed", "2").reason
        assert row(manager, "embed", "2").state is UNAVAILABLE
        assert "unsupported architecture BertPlus" in reason
        assert str(repo.root) not in reason and "embed/2" in reason  # shown repository-relative
        with pytest.raises(EngineUnavailableError):
            manager.get("embed", "2")
        # The canary's half of the traffic falls back on the ready version.
        assert split(manager, "embed", 10) == {"1": 10}
        assert manager.get("embed") is v1 and manager.is_ready()

        await manager.rescan()  # same files: not retried
        assert loader.calls.count(("embed", "2")) == 1
        del loader.failures[("embed", "2")]
        repo.replace("embed", 2)  # fixed files: retried
        await manager.rescan()
        assert states(manager, "embed") == {"1": READY, "2": READY}
        assert row(manager, "embed", "2").reason == ""
        assert split(manager, "embed", 10) == {"1": 5, "2": 5}
        await manager.shutdown()

    run(scenario())


def test_a_version_folder_scan_rejects_is_unavailable_without_loading(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)
    (repo.root / "embed" / "2").mkdir()
    (repo.root / "embed" / "2" / "notes.txt").write_text("no weights here")

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="none")
        await manager.start()
        assert loader.calls == [("embed", "1")]
        failed = row(manager, "embed", "2")
        assert failed.state is UNAVAILABLE and "no config.json" in failed.reason
        assert manager.get("embed").version == "1"
        await manager.shutdown()

    run(scenario())


def test_a_failing_replacement_keeps_the_old_instance_and_reports_it(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        old = manager.get("embed")
        repo.replace("embed", 1)
        loader.fail("embed", "1", "truncated safetensors header")
        await manager.rescan()

        status = row(manager, "embed", "1")
        assert status.state is READY
        assert "reload failed" in status.reason and "truncated safetensors header" in status.reason
        assert manager.get("embed", "1") is old and old.num_stops == 0

        await manager.rescan()  # the same broken files are not retried on every poll
        assert loader.calls.count(("embed", "1")) == 2

        del loader.failures[("embed", "1")]
        repo.replace("embed", 1)
        await manager.rescan()
        new = manager.get("embed", "1")
        assert new is not old and old.num_stops == 1 and row(manager, "embed", "1").reason == ""
        await manager.shutdown()

    run(scenario())


def test_a_model_whose_versions_all_fail_does_not_block_readiness(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)
    repo.model("broken", 1)
    loader.fail("broken", "1", "out of memory")

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="none")
        await manager.start()
        assert manager.not_ready_reason() is None and manager.is_ready()
        assert manager.model_names() == ["embed"]
        assert manager.ready_versions("broken") == []
        assert row(manager, "broken", "1").state is UNAVAILABLE
        with pytest.raises(EngineUnavailableError):
            manager.get("broken")
        await manager.shutdown()

    run(scenario())


def test_explicit_load_of_a_failing_model_reports_it_without_raising(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)
    loader.fail("embed", "1", "no tokenizer")

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="explicit")
        await manager.start()
        await manager.load("embed")
        assert row(manager, "embed", "1").state is UNAVAILABLE
        assert "no tokenizer" in row(manager, "embed", "1").reason
        await manager.shutdown()

    run(scenario())


# --- leaving versions --------------------------------------------------------------------------


def test_unload_stops_routing_at_once_and_waits_for_in_flight_requests(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="explicit", startup_models=["embed"])
        await manager.start()
        served = manager.get("embed")
        served.gate.clear()
        request = asyncio.create_task(served.infer({}))
        await until(lambda: served.num_in_flight == 1, "the request is in flight")

        unload = asyncio.create_task(manager.unload("embed"))
        await until(lambda: states(manager, "embed") == {"1": UNLOADING}, "v1 is unloading")
        with pytest.raises(EngineUnavailableError):
            manager.get("embed")
        assert manager.model_names() == [] and manager.num_unfinished() == 1
        polls = served.num_polls
        await until(lambda: served.num_polls >= polls + 3, "the drain polls a few times")
        assert served.num_stops == 0 and not unload.done()

        served.gate.set()
        assert (await request)["version"].tolist() == [1]
        await unload
        assert served.num_stops == 1 and manager.index() == []
        with pytest.raises(ModelNotFoundError):
            manager.get("embed")
        await manager.shutdown()
        assert served.num_stops == 1

    run(scenario())


def test_a_removed_version_finishes_its_requests_before_it_stops(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1, 2)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        v1, v2 = manager.get("embed", "1"), manager.get("embed", "2")
        v1.gate.clear()
        request = asyncio.create_task(v1.infer({}))
        await until(lambda: v1.num_in_flight == 1, "the request is in flight")

        repo.remove("embed", 1)
        rescan = asyncio.create_task(manager.rescan())
        await until(lambda: states(manager, "embed")["1"] is UNLOADING, "v1 is unloading")
        with pytest.raises(EngineUnavailableError):
            manager.get("embed", "1")
        assert manager.ready_versions("embed") == ["2"] and manager.get("embed") is v2
        assert v1.num_stops == 0

        v1.gate.set()
        await request
        await rescan
        assert v1.num_stops == 1 and states(manager, "embed") == {"2": READY}
        await manager.shutdown()

    run(scenario())


def test_a_replaced_instance_finishes_its_requests_before_it_stops(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        old = manager.get("embed")
        old.gate.clear()
        request = asyncio.create_task(old.infer({}))
        await until(lambda: old.num_in_flight == 1, "the request is in flight")

        repo.replace("embed", 1)
        rescan = asyncio.create_task(manager.rescan())
        await until(lambda: manager.get("embed") is not old, "the new instance takes traffic")
        assert old.num_stops == 0
        # Its request still counts, so a server drain waits for it.
        assert manager.num_unfinished() == 1

        old.gate.set()
        await request
        await rescan
        assert old.num_stops == 1 and manager.num_unfinished() == 0
        await manager.shutdown()

    run(scenario())


def test_a_stuck_request_holds_an_unload_only_up_to_the_drain_timeout(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(
            loader, repo.root, mode="explicit", startup_models=["embed"], drain_timeout=0.05
        )
        await manager.start()
        served = manager.get("embed")
        served.gate.clear()
        request = asyncio.create_task(served.infer({}))
        await until(lambda: served.num_in_flight == 1, "the request is in flight")
        await manager.unload("embed")
        assert served.num_stops == 1 and served.num_in_flight == 1
        served.gate.set()
        await request
        await manager.shutdown()

    run(scenario())


# --- routing -----------------------------------------------------------------------------------


def test_routing_pinned_default_unknown_and_not_ready(repo: Repo, loader: FakeLoader) -> None:
    repo.model("embed", 1, 2, 10)
    loader.fail("embed", "10", "bad weights")

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="none")
        await manager.start()
        assert manager.get("embed", "1").version == "1"
        assert manager.get("embed", "2", user="alice").version == "2"  # pinned beats sticky
        # Without traffic weights: all to the newest ready version (numerically, 10 failed).
        assert split(manager, "embed", 5) == {"2": 5}
        assert manager.traffic("embed") == {"2": 1.0}
        with pytest.raises(ModelNotFoundError, match="'nope' is not served"):
            manager.get("nope")
        with pytest.raises(ModelNotFoundError, match="no version '3'"):
            manager.get("embed", "3")
        with pytest.raises(EngineUnavailableError, match=r"version 10 .* not ready"):
            manager.get("embed", "10")
        manager.draining = True
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            manager.get("embed", "1")
        await manager.shutdown()

    run(scenario())


def test_config_traffic_splits_exactly_90_10_without_users(repo: Repo, loader: FakeLoader) -> None:
    repo.model("embed", 1, 2, config=ALL_VERSIONS + 'traffic: {"1": 90, "2": 10}\n')

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="none")
        await manager.start()
        assert manager.traffic("embed") == pytest.approx({"1": 0.9, "2": 0.1})
        picks = [manager.get("embed").version for _ in range(1000)]
        assert Counter(picks) == {"1": 900, "2": 100}
        # Smooth: every run of 10 consecutive requests holds exactly one for the canary.
        assert all(picks[i : i + 10].count("2") == 1 for i in range(len(picks) - 9))
        await manager.shutdown()

    run(scenario())


def test_sticky_users_stay_on_one_version_and_split_by_the_weights(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1, 2, config=ALL_VERSIONS + 'traffic: {"1": 90, "2": 10}\n')

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="none")
        await manager.start()
        chosen = {}
        for i in range(2000):
            user = f"user-{i}"
            seen = {manager.get("embed", user=user).version for _ in range(5)}
            manager.get("embed")  # unsticky requests in between change nothing for users
            assert len(seen) == 1, user
            chosen[user] = seen.pop()
        share = Counter(chosen.values())["2"] / len(chosen)
        assert 0.07 <= share <= 0.13  # 10 % +- ~4.5 standard deviations of 2,000 draws
        await manager.shutdown()

    run(scenario())


def test_set_traffic_validates_and_changes_the_split(repo: Repo, loader: FakeLoader) -> None:
    repo.model("embed", 1, 2, 3)
    repo.add("embed", 4)
    loader.fail("embed", "3", "bad weights")

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        bad: list[tuple[dict[str, float], str]] = [
            ({"7": 1}, "not ready"),  # unknown version
            ({"3": 1}, "not ready"),  # failed version
            ({"1": -1}, ">= 0"),
            ({"1": float("inf")}, ">= 0"),
            ({"1": 0, "2": 0}, "> 0"),
            ({"x": 1}, "must be a number"),
        ]
        for weights, message in bad:
            with pytest.raises(ConfigError, match=message):
                manager.set_traffic("embed", weights)
        with pytest.raises(ModelNotFoundError):
            manager.set_traffic("nope", {"1": 1})
        assert split(manager, "embed", 8) == {"4": 8}  # unchanged by the refused calls

        manager.set_traffic("embed", {"1": 1, "2": 3, "4": 0})
        assert manager.traffic("embed") == {"1": 0.25, "2": 0.75}
        assert split(manager, "embed", 1000) == {"1": 250, "2": 750}
        await manager.rescan()  # an unchanged config keeps the weights set by the API
        assert manager.traffic("embed") == {"1": 0.25, "2": 0.75}
        await manager.shutdown()

    run(scenario())


def test_a_traffic_only_config_edit_changes_weights_without_reloading(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1, 2, config=ALL_VERSIONS + 'traffic: {"1": 90, "2": 10}\n')

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        v1, v2 = manager.get("embed", "1"), manager.get("embed", "2")

        repo.config("embed", ALL_VERSIONS + 'traffic: {"1": 50, "2": 50}\n')
        await manager.rescan()
        assert len(loader.calls) == 2 and (v1.num_stops, v2.num_stops) == (0, 0)
        assert split(manager, "embed", 1000) == {"1": 500, "2": 500}

        repo.config("embed", ALL_VERSIONS + 'traffic: {"1": 50, "2": 50}\nmax_batch_size: 8\n')
        await manager.rescan()
        assert sorted(loader.calls[2:]) == [("embed", "1"), ("embed", "2")]
        assert (v1.num_stops, v2.num_stops) == (1, 1)
        new = manager.get("embed", "1")
        assert new is not v1 and new.entry.config.max_batch_size == 8
        assert split(manager, "embed", 1000) == {"1": 500, "2": 500}
        await manager.shutdown()

    run(scenario())


# --- index and readiness -----------------------------------------------------------------------


def test_index_model_names_and_ready_versions(repo: Repo, loader: FakeLoader) -> None:
    repo.model("zeta", 10, 2, 9)
    repo.model("alpha", 1)
    repo.model("down", 1)
    loader.fail("zeta", "9", "boom")
    loader.fail("down", "1", "boom")

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="none")
        await manager.start()
        assert [(s.model, s.version, s.state) for s in manager.index()] == [
            ("alpha", "1", READY),
            ("down", "1", UNAVAILABLE),
            ("zeta", "2", READY),
            ("zeta", "9", UNAVAILABLE),
            ("zeta", "10", READY),
        ]
        assert manager.model_names() == ["alpha", "zeta"]
        assert manager.ready_versions("zeta") == ["2", "10"]
        assert manager.ready_versions("down") == [] and manager.ready_versions("nope") == []
        assert manager.get("zeta").version == "10"
        await manager.shutdown()

    run(scenario())


def test_not_ready_reason_reports_draining_and_unhealthy_versions(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="none")
        await manager.start()
        assert manager.not_ready_reason() is None
        manager.get("embed").health = (False, "engine stalled for 30 s")
        assert manager.not_ready_reason() == "model 'embed': engine stalled for 30 s"
        manager.draining = True
        assert manager.not_ready_reason() == "draining" and not manager.is_ready()
        await manager.shutdown()

    run(scenario())


def test_a_broken_config_is_reported_and_loaded_versions_keep_serving(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)
    repo.config("new", "backend: embedding\nmax_batch_size: many\n")
    repo.add("new", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        # A model that never had a good config: reported, nothing loaded, not in the way.
        (new,) = [s for s in manager.index() if s.model == "new"]
        assert (new.version, new.state) == ("", UNAVAILABLE)
        assert "models/new/config.yaml" in new.reason and "max_batch_size" in new.reason
        assert loader.calls == [("embed", "1")] and manager.is_ready()
        with pytest.raises(ModelNotFoundError):
            manager.get("new")

        served = manager.get("embed")
        good = (repo.root / "embed" / "config.yaml").read_text()
        repo.config("embed", good + "unknown_key: 1\n")
        repo.replace("embed", 1)  # even changed files wait for a good config
        await manager.rescan()
        rows = [s for s in manager.index() if s.model == "embed"]
        assert [(s.version, s.state) for s in rows] == [("", UNAVAILABLE), ("1", READY)]
        assert "unknown_key" in rows[0].reason
        assert manager.get("embed") is served and served.num_stops == 0
        assert len(loader.calls) == 1

        repo.config("embed", good)
        await manager.rescan()
        assert [s.version for s in manager.index() if s.model == "embed"] == ["1"]
        assert manager.get("embed") is not served and served.num_stops == 1
        await manager.shutdown()

    run(scenario())


def test_explicit_load_of_a_broken_config_is_a_config_error(repo: Repo, loader: FakeLoader) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="explicit", startup_models=["embed"])
        await manager.start()
        served = manager.get("embed")
        repo.config("embed", "backend: tensorflow\n")
        with pytest.raises(ConfigError, match=r"models/embed/config\.yaml: backend"):
            await manager.load("embed")
        assert "backend" in manager.index()[0].reason
        assert manager.get("embed") is served and served.num_stops == 0
        await manager.shutdown()

    run(scenario())


# --- shutdown and concurrent control -----------------------------------------------------------


def test_shutdown_stops_every_version_once(repo: Repo, loader: FakeLoader) -> None:
    repo.model("embed", 1, 2)
    repo.model("chat", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        await manager.shutdown()
        assert len(loader.built) == 3
        assert [s.num_stops for s in loader.built] == [1, 1, 1]
        assert manager._poll_task is not None and manager._poll_task.done()

    run(scenario())


def test_shutdown_stops_an_instance_the_poll_loop_is_retiring(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=0.01)
        await manager.start()
        old = manager.get("embed")
        old.gate.clear()
        request = asyncio.create_task(old.infer({}))
        await until(lambda: old.num_in_flight == 1, "the request is in flight")
        repo.replace("embed", 1)
        await until(lambda: manager.get("embed") is not old, "the poll replaces v1")
        new = manager.get("embed")

        await manager.shutdown()  # while the poll loop waits for the old instance's request
        assert (old.num_stops, new.num_stops) == (1, 1)
        old.gate.set()
        await request

    run(scenario())


def test_shutdown_stops_a_version_the_poll_loop_is_removing_once(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1, 2)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=0.01)
        await manager.start()
        v1, v2 = manager.get("embed", "1"), manager.get("embed", "2")
        v1.gate.clear()
        request = asyncio.create_task(v1.infer({}))
        await until(lambda: v1.num_in_flight == 1, "the request is in flight")
        repo.remove("embed", 1)
        await until(lambda: states(manager, "embed")["1"] is UNLOADING, "the poll removes v1")

        await manager.shutdown()  # while the poll loop waits for v1's request
        assert (v1.num_stops, v2.num_stops) == (1, 1)
        assert states(manager, "embed") == {"2": READY}
        v1.gate.set()
        await request

    run(scenario())


def test_a_load_queued_behind_an_unload_of_the_same_model_takes_effect(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="explicit")
        await manager.start()
        block = loader.block("embed", "1")
        first = asyncio.create_task(manager.load("embed"))
        await until(block.entered.is_set, "the first load is building v1")
        unload = asyncio.create_task(manager.unload("embed"))
        second = asyncio.create_task(manager.load("embed"))
        await asyncio.sleep(0)  # both reach the model's lock behind the first load
        block.release.set()
        await asyncio.gather(first, unload, second)

        # Load, unload, load: the model is served by the second load's instance.
        first_instance, second_instance = loader.instances("embed", "1")
        assert first_instance.num_stops == 1
        assert manager.get("embed") is second_instance
        assert manager.index() == [VersionStatus("embed", "1", READY)]
        await manager.shutdown()
        assert second_instance.num_stops == 1

    run(scenario())


def test_static_serves_a_prebuilt_version(tmp_path: Path) -> None:
    entry = ModelEntry("m", tmp_path, None)
    served = FakeVersion("m", "1", entry)

    async def scenario() -> None:
        manager = ModelManager.static([served])
        assert not manager.is_ready()  # not started yet
        await manager.start()
        assert served.num_starts == 1 and manager.get("m") is served
        assert manager.index() == [VersionStatus("m", "1", READY)]
        with pytest.raises(ConfigError, match="explicit"):
            await manager.load("m")
        await manager.shutdown()
        assert served.num_stops == 1

    run(scenario())


LATEST_ONE = "backend: embedding\n"  # the default policy: the newest version only


def test_latest_policy_keeps_the_old_version_serving_until_the_new_one_is_ready(
    repo: Repo, loader: FakeLoader
) -> None:
    repo.model("embed", 1, config=LATEST_ONE)

    async def scenario() -> None:
        manager = ModelManager(loader, repo.root, mode="poll", poll_interval=3600)
        await manager.start()
        repo.add("embed", 2)
        gate = loader.block("embed", "2")
        rescan = asyncio.create_task(manager.rescan())
        await until(lambda: states(manager, "embed").get("2") is LOADING, "v2 loading")
        # No gap: version 1 still serves while version 2 loads.
        assert manager.get("embed").version == "1" and manager.is_ready()
        gate.release.set()
        await rescan
        assert states(manager, "embed") == {"2": READY}
        assert manager.get("embed").version == "2"
        (v1,) = loader.instances("embed", "1")
        assert v1.num_stops == 1

        # Version 3 fails: the policy selects it alone, but version 2 keeps serving.
        repo.add("embed", 3)
        loader.fail("embed", "3", "broken weights")
        await manager.rescan()
        assert states(manager, "embed") == {"2": READY, "3": UNAVAILABLE}
        assert manager.get("embed").version == "2"
        await manager.shutdown()

    run(scenario())
