"""`qiao repository gc`: remove local copies of remote repository versions no longer needed.

    qiao repository gc [--repository URL] [--cache-dir DIR] [--unused-days N] [--dry-run]

Without `--repository`, every repository cached under the cache folder is collected, each
listed at the URL its cache root records. A repository that cannot be listed (offline, no
credentials) loses only incomplete copies and, with `--unused-days`, unused ones. Copies that a
running server uses are never removed (`cache_gc` has the rules and the safety rule).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from qiao.api.settings import default_data_dir
from qiao.errors import ConfigError, QiaoError
from qiao.repository.cache import CACHE_DIR_NAME, cache_root, normalize_url
from qiao.repository.cache_gc import GcReport, ServedCopies, cached_repositories, collect_garbage
from qiao.repository.cache_gc import format_size as size
from qiao.repository.remote import open_repository, served_versions


def default_cache_dir() -> Path:
    """Where `qiao serve` keeps its copies: QIAO_REPOSITORY_CACHE_DIR, else
    <QIAO_DATA_DIR or the default data dir>/repository-cache (the server reads the same
    variables)."""
    if os.environ.get("QIAO_REPOSITORY_CACHE_DIR"):
        return Path(os.environ["QIAO_REPOSITORY_CACHE_DIR"])
    data_dir = os.environ.get("QIAO_DATA_DIR")
    return (Path(data_dir) if data_dir else default_data_dir()) / CACHE_DIR_NAME


def add_repository_command(sub: argparse._SubParsersAction) -> None:
    """Register `qiao repository` and its subcommand `gc`."""
    repository = sub.add_parser(
        "repository",
        help="model repository tools: gc (clean the local cache of a remote repository)",
        description="Tools for a model repository on object storage.",
    )
    commands = repository.add_subparsers(dest="repository_command", required=True)
    gc = commands.add_parser(
        "gc",
        help="remove cached copies of versions no longer served or long unused",
        description="Remove the local copies of remote repository versions that are no longer "
        "served (gone from the repository, outside its version_policy, or replaced remotely), "
        "incomplete (interrupted downloads), or, with --unused-days, not used for N days. A "
        "copy a running server uses is never removed. Prints each copy removed, its size and "
        "the total.",
    )
    gc.add_argument(
        "--repository",
        metavar="URL",
        help="only this repository (s3://..., gs://..., memory://...), listed to know what it "
        "serves (default: every repository in the cache, at the URL each recorded)",
    )
    gc.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the cache folder: the server's --repository-cache-dir (default: "
        "QIAO_REPOSITORY_CACHE_DIR, else <QIAO_DATA_DIR or the default data dir>/repository-cache, "
        "as the server chooses it)",
    )
    gc.add_argument(
        "--unused-days",
        type=_days,
        default=None,
        metavar="N",
        help="also remove copies not used for N days (a fraction is fine)",
    )
    gc.add_argument("--dry-run", action="store_true", help="print what would go; remove nothing")
    gc.set_defaults(func=_cmd_gc)


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError("--unused-days must be >= 0")
    return value


def _cmd_gc(args: argparse.Namespace) -> int:
    cache_dir: Path = args.cache_dir or default_cache_dir()
    if args.repository is not None:
        if not open_repository(args.repository, cache_dir).is_remote:
            raise ConfigError(f"{args.repository} is a local folder: it has no cache")
        roots = {cache_root(cache_dir, args.repository): normalize_url(args.repository)}
    else:
        roots = cached_repositories(cache_dir)
    if not any(root.is_dir() for root in roots):
        print(f"nothing cached in {cache_dir}")
        return 0
    total, count, failed = 0, 0, False
    for root, url in roots.items():
        if not root.is_dir():
            continue
        served = _served(url, cache_dir)
        failed |= served is None
        report = collect_garbage(root, served, unused_days=args.unused_days, dry_run=args.dry_run)
        _print_report(url, report, args.dry_run)
        total += report.total_bytes
        count += len(report.removed)
    verb = "would remove" if args.dry_run else "removed"
    print(f"total: {verb} {count} item(s), {size(total)} ({total} bytes)")
    return 1 if failed else 0


def _served(url: str, cache_dir: Path) -> ServedCopies | None:
    """What the repository at `url` serves now, by (model, version); None if it cannot be
    listed (said on stderr)."""
    try:
        repository = open_repository(url, cache_dir)
        assert repository.scan is not None
        entries = repository.scan(logging.getLogger("qiao.repository").warning)
    except (QiaoError, OSError, ImportError) as exc:
        print(
            f"qiao: warning: cannot list {url} ({exc}); removing only its incomplete copies "
            "and, with --unused-days, its unused ones",
            file=sys.stderr,
        )
        return None
    return served_versions(entries)


def _print_report(url: str, report: GcReport, dry_run: bool) -> None:
    verb = "would remove" if dry_run else "removed"
    print(f"{url}:")
    for item in report.removed:
        print(f"  {verb}  {item.label}  {size(item.size)}  ({item.reason})")
    for label, why in report.kept:
        print(f"  kept  {label}  ({why})")
