"""The kernel build cache: a finished build loads with no compiler, no ninja and no lock; a build
killed while holding its locks never hangs the next start; a lock held too long ends in an error
naming it. Builds here use a probe extension of a few lines (no torch headers, about a second),
in their own cache folder."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qiao.kernels import KernelBuildTimeout, build_dir_for, load_or_build

PROBE = textwrap.dedent(
    """
    #include <Python.h>
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "qiao_probe", "", -1, methods};
    PyMODINIT_FUNC PyInit_qiao_probe(void) { return PyModule_Create(&module); }
    """
)
FLAGS = ["-O0"]

# Runs in a child: build (or load) the probe, recording every process it starts.
CHILD = textwrap.dedent(
    """
    import json, subprocess, sys
    from pathlib import Path
    started = []
    real_init = subprocess.Popen.__init__
    def recording_init(self, args, *a, **k):
        started.append(args if isinstance(args, str) else [str(x) for x in args])
        real_init(self, args, *a, **k)
    subprocess.Popen.__init__ = recording_init
    from qiao.kernels import load_or_build
    module = load_or_build("qiao_probe", Path(sys.argv[1]), ["-O0"], [], timeout=120)
    print(json.dumps({"answer": module.answer(), "started": started}))
    """
)


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if not any(Path(d, "c++").exists() for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("no C++ compiler on PATH")
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE)
    monkeypatch.setenv("QIAO_CACHE_DIR", str(tmp_path / "cache"))
    return source


def _child(source: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(source)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
        start_new_session=True,  # its own process group: killed with the compiler it runs
    )


def _result(proc: subprocess.Popen[str]) -> dict:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_a_finished_build_loads_without_starting_any_process(probe: Path) -> None:
    first = _result(_child(probe))
    assert first["answer"] == 42
    assert any("ninja" in " ".join(cmd) for cmd in first["started"])  # it did build
    second = _result(_child(probe))
    assert second == {"answer": 42, "started": []}  # no compiler, no ninja


def test_a_build_killed_holding_its_locks_does_not_hang_the_next(
    probe: Path, tmp_path: Path
) -> None:
    # A compiler that stalls, so the first build is surely inside torch's build (its `lock`
    # file taken) when it is killed.
    slow = tmp_path / "slow-c++"
    slow.write_text('#!/bin/sh\nsleep 300\nexec c++ "$@"\n')
    slow.chmod(0o755)
    victim = _child(probe, CXX=str(slow))
    torch_lock = build_dir_for(probe, FLAGS) / "work" / "lock"
    deadline = time.monotonic() + 120
    while not torch_lock.exists():
        assert victim.poll() is None, victim.communicate()[0]
        assert time.monotonic() < deadline, "the first build never started"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert torch_lock.exists()  # what used to make every later start wait forever
    after = _result(_child(probe))
    assert after["answer"] == 42


def test_a_lock_held_past_the_timeout_is_an_error_naming_it(probe: Path) -> None:
    build_dir = build_dir_for(probe, FLAGS)
    build_dir.mkdir(parents=True)
    lock_path = build_dir / "build.lock"
    with open(lock_path, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(json.dumps({"pid": 4242}))
        held.flush()
        started = time.monotonic()
        with pytest.raises(KernelBuildTimeout) as caught:
            load_or_build("qiao_probe", probe, FLAGS, [], timeout=0.5)
        waited = time.monotonic() - started
    message = str(caught.value)
    assert str(lock_path) in message and "pid 4242" in message
    assert "QIAO_KERNEL_BUILD_TIMEOUT" in message
    assert waited >= 0.5  # it waited for the holder, then gave up


def test_setup_reports_the_kernels() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "qiao.kernels"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "C++ CPU kernels:" in result.stdout
