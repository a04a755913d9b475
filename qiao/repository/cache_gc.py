"""Garbage collection of the repository cache: which local copies go, and removing them.

A copy is removed when it is incomplete (an interrupted download, a copy without its
manifest), when the repository no longer serves it (the version left the listing or its
`version_policy`, or its remote files were replaced, so a newer copy supersedes it), or when it
was not used for `unused_days`. Whatever the rule, a copy with a live lease (a running server's
instance loaded from it) is kept, and a version whose lock is held (a server copying it now) is
skipped; the check and the removal happen under that lock, so a server cannot lease a copy
while it is being removed.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from qiao.repository.cache import (
    LEASE_MARK,
    LOCK_FILE,
    MANIFEST_SUFFIX,
    NEW_PREFIX,
    ROOT_FILE,
    TMP_PREFIX,
    TRASH_PREFIX,
    lease_holder,
    read_complete_manifest,
    remove_tree,
    tree_size,
    version_lock,
)
from qiao.repository.scan import is_model_name, is_version_name

# (model, version) -> the signature of the copy the repository serves now ("" when unknown).
ServedCopies = dict[tuple[str, str], str]


@dataclass(frozen=True)
class Removal:
    label: str  # "model/version signature"
    size: int
    reason: str


@dataclass
class GcReport:
    removed: list[Removal] = field(default_factory=list)  # or, in a dry run, to be removed
    kept: list[tuple[str, str]] = field(default_factory=list)  # (label, why)

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.removed)


def cached_repositories(cache_dir: Path) -> dict[Path, str]:
    """Every repository root under `cache_dir`, with the URL it caches."""
    roots = {}
    for root in sorted(cache_dir.iterdir()) if cache_dir.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            roots[root] = str(json.loads((root / ROOT_FILE).read_text())["url"])
    return roots


def collect_garbage(
    root: Path,
    served: ServedCopies | None,
    *,
    unused_days: float | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Remove (or with `dry_run`, only list) the copies under the cache root `root` that the
    rules of the module docstring select. `served`: the repository's versions now, or None when
    it cannot be listed (then only incomplete and unused copies go)."""
    report = GcReport()
    now = time.time() if now is None else now
    for model_dir in sorted(root.iterdir()) if root.is_dir() else []:
        if not (model_dir.is_dir() and is_model_name(model_dir.name)):
            continue
        for vdir in sorted(model_dir.iterdir(), key=lambda p: p.name):
            if vdir.is_dir() and is_version_name(vdir.name):
                rules = _Rules(served, unused_days, now)
                _collect_version(model_dir.name, vdir, rules, dry_run, report)
    return report


@dataclass(frozen=True)
class _Rules:
    served: ServedCopies | None
    unused_days: float | None
    now: float

    def why_remove(self, key: tuple[str, str], sig: str, last_used: float | None) -> str | None:
        if self.served is not None:
            if key not in self.served:
                return "no longer served (gone from the repository or outside its version_policy)"
            if self.served[key] not in ("", sig):
                return "replaced: the remote version changed"
        if self.unused_days is not None and (last_used or 0.0) < (
            self.now - self.unused_days * 86400
        ):
            return f"unused for {self.unused_days:g} days"
        return None


def _collect_version(
    model: str, vdir: Path, rules: _Rules, dry_run: bool, report: GcReport
) -> None:
    version = vdir.name
    with version_lock(vdir, blocking=False) as locked:
        if not locked:
            report.kept.append((f"{model}/{version}", "busy: a server is copying it"))
            return
        sigs: set[str] = set()
        holders: dict[str, list[int]] = {}
        for item in sorted(vdir.iterdir(), key=lambda p: p.name):
            name = item.name
            if name == LOCK_FILE:
                continue
            if name.startswith((TMP_PREFIX, TRASH_PREFIX, NEW_PREFIX)):
                # Under the lock nobody writes here: a crashed download or write.
                report.removed.append(
                    Removal(f"{model}/{version} {name}", tree_size(item), "interrupted download")
                )
                if not dry_run:
                    _remove(item)
            elif LEASE_MARK in name:
                sig = name.split(LEASE_MARK, 1)[0]
                pid = lease_holder(item)
                if pid is not None:
                    holders.setdefault(sig, []).append(pid)
                elif not dry_run:
                    item.unlink(missing_ok=True)  # its process is gone
            else:
                sigs.add(name.removesuffix(MANIFEST_SUFFIX))
        for sig in sorted(sigs):
            label = f"{model}/{version} {sig}"
            if sig in holders:
                pids = ", ".join(str(p) for p in sorted(holders[sig]))
                report.kept.append((label, f"in use by pid {pids}"))
                continue
            copy, manifest = vdir / sig, vdir / (sig + MANIFEST_SUFFIX)
            data = read_complete_manifest(copy, manifest)
            if data is None:
                reason: str | None = "incomplete copy"
            else:
                reason = rules.why_remove((model, version), sig, data.get("last_used"))
            if reason is None:
                report.kept.append((label, "served"))
                continue
            report.removed.append(Removal(label, tree_size(copy) + tree_size(manifest), reason))
            if not dry_run:
                remove_tree(copy)
                manifest.unlink(missing_ok=True)


def _remove(path: Path) -> None:
    if path.is_dir():
        remove_tree(path)
    else:
        path.unlink(missing_ok=True)


def format_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
