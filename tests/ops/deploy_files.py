"""Readers of the deployment files as Docker and Kubernetes read them: the Dockerfile's stages and
ENV, .dockerignore's patterns, kustomize's rendering (the features deploy/k8s uses) and the
environment the kubelet gives a container."""

from __future__ import annotations

import copy
import json
import math
import re
import secrets
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S = ROOT / "deploy" / "k8s"
BASE, GPU = K8S / "base", K8S / "gpu"
SECRET = K8S / "secret.yaml"
ADAPTER = K8S / "prometheus-adapter.yaml"

# --- the Dockerfile ----------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [rest for name, rest in self.instructions if name == op]

    def one(self, op: str) -> str:
        (rest,) = self.all(op)
        return rest


def _logical_lines(text: str) -> Iterator[str]:
    """Instructions with their continuation lines joined and comment lines dropped."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield pending + line
        pending = ""


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults and the stages, in order."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages and op == "ARG":
            key, _, value = rest.partition("=")
            args[key] = value
        else:
            stages[-1].instructions.append((op, rest))
    return args, stages


def stage_env(stages: list[Stage], stage: Stage, args: dict[str, str]) -> dict[str, str]:
    """ENV in effect in `stage`: its base stage's (a stage of this file), then its own."""
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage.base)
    parents = [s for s in stages if s.name == base]
    env = stage_env(stages, parents[0], args) if parents else {}
    for rest in stage.all("ENV"):
        env.update(word.split("=", 1) for word in shlex.split(rest))
    return env


def healthcheck_argv(runtime: Stage) -> list[str]:
    _, _, command = runtime.one("HEALTHCHECK").partition(" CMD ")
    return json.loads(command)


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves `path` (relative, '/'-separated) out of the build context: the
    last pattern matching it or one of its parent folders decides; '!' re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def _glob_regex(pattern: str) -> re.Pattern[str]:
    # E.g. "**/__pycache__" -> "(?:.*/)?__pycache__", "qiao/*.py" -> "qiao/[^/]*\.py"
    out = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
    return re.compile(out.replace(r"\*", "[^/]*").replace(r"\?", "[^/]"))


def dockerignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


# --- the manifests -----------------------------------------------------------------------------


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def strategic_merge(base: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge, as far as these manifests need: maps merge key by key, lists
    of named items (containers, env, volumes) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else value
        return merged
    named = (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(item, dict) and "name" in item for item in base + patch)
    )
    if named:
        merged_items = {item["name"]: item for item in base}
        for item in patch:
            name = item["name"]
            merged_items[name] = strategic_merge(merged_items.get(name, {}), item)
        return list(merged_items.values())
    return patch


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize DIR` renders, for the features deploy/k8s uses (resources,
    patches, namespace)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    resources: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        resources += kustomize(path) if path.is_dir() else load_all(path)
    resources = copy.deepcopy(resources)
    for patch_entry in spec.get("patches", []):
        patch = yaml.safe_load((directory / patch_entry["path"]).read_text())
        index = next(
            i
            for i, r in enumerate(resources)
            if (r["kind"], r["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])
        )
        resources[index] = strategic_merge(resources[index], patch)
    if "namespace" in spec:
        for resource in resources:
            if resource["kind"] != "Namespace":
                resource["metadata"]["namespace"] = spec["namespace"]
    return resources


def only(resources: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (resource,) = [r for r in resources if r["kind"] == kind]
    return resource


def qiao_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"]]
    return container


def cpu_quantity(value: str) -> float:
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def container_env(deployment: dict[str, Any], secret: dict[tuple[str, str], str]) -> dict[str, str]:
    """The environment the kubelet gives the container: values with $(VAR) expanded from the
    entries before them, secret keys from `secret` ((name, key) -> value), CPU resource fields
    rounded up by their divisor."""
    container = qiao_container(deployment)
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            value = secret[(ref["name"], ref["key"])]
        else:
            ref = item["valueFrom"]["resourceFieldRef"]
            kind, _, resource = ref["resource"].partition(".")
            assert resource == "cpu", ref
            quantity = cpu_quantity(container["resources"][kind]["cpu"])
            value = str(math.ceil(quantity / cpu_quantity(ref.get("divisor", "1"))))
        env[item["name"]] = value
    return env


def probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: container[name]
        for name in ("startupProbe", "livenessProbe", "readinessProbe")
        if name in container
    }


def shipped_secret() -> dict[tuple[str, str], str]:
    (secret,) = load_all(SECRET)
    values = {**secret.get("data", {}), **secret.get("stringData", {})}
    return {(secret["metadata"]["name"], key): value for key, value in values.items()}


def filled_secret() -> dict[tuple[str, str], str]:
    """The shipped Secret's keys, each set to a fresh key as docs/deploy.md says to."""
    return {ref: secrets.token_urlsafe() for ref in shipped_secret()}


def config_map(resources: list[dict[str, Any]], name: str) -> dict[str, str]:
    (found,) = [r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == name]
    return found["data"]


def serve_config(resources: list[dict[str, Any]], env: dict[str, str]) -> tuple[str, str]:
    """(ConfigMap name, key) of the file QIAO_CONFIG names, through the container's mounts."""
    deployment = only(resources, "Deployment")
    path = Path(env["QIAO_CONFIG"])
    mounts = {m["mountPath"]: m["name"] for m in qiao_container(deployment)["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    volume = volumes[mounts[str(path.parent)]]
    return volume["configMap"]["name"], path.name
