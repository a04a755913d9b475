"""The repository scan and its path safety: name rules, contained paths, version policies, kinds,
fingerprints, and symlinks that leave the repository never followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qiao.errors import ConfigError
from qiao.repository.scan import (
    NAME_RULE,
    VERSION_RULE,
    check_model_name,
    check_version,
    resolve_inside,
    scan_repository,
)

EMBED_CONFIG = "backend: embedding\nversion_policy: {latest: {num_versions: 2}}\n"


def write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def hf_version(path: Path) -> Path:
    write(path / "config.json", '{"model_type": "bert"}')
    write(path / "model.safetensors", "weights")
    return path


def onnx_version(path: Path) -> Path:
    write(path / "model.onnx", "onnx bytes")
    write(path / "tokenizer.json", "{}")
    return path


class Warnings(list[str]):
    def __call__(self, message: str) -> None:
        self.append(message)

    def mention(self, text: str) -> bool:
        return any(text in message for message in self)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the repository, with things worth stealing."""
    secret = tmp_path / "outside"
    write(secret / "config.yaml", "backend: [this file must never be read\n")
    hf_version(secret / "stolen_model" / "1")
    write(secret / "stolen_model" / "config.yaml", "backend: embedding\n")
    hf_version(secret / "9")
    write(secret / "weights.safetensors", "secret weights")
    return secret


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    return root


# --- names ------------------------------------------------------------------------------------

GOOD_NAMES = ["a", "embed", "all-MiniLM-L6-v2", "model_1.onnx", "X", "9lives", "a..b", "a" * 128]
BAD_NAMES = [
    "",
    ".",
    "..",
    "../x",
    "x/..",
    "/etc",
    "a/b",
    "a\\b",
    "..\\..",
    "%2e%2e",
    "a%2Fb",
    "a\x00b",
    "\x00",
    "a b",
    " a",
    "a\n",
    "a\t",
    "\u0430bc",  # Cyrillic a
    "\uff41bc",  # fullwidth a
    "ab\u200b",  # zero-width space
    "caf\u00e9",
    "-a",
    "_a",
    ".hidden",
    "a" * 129,
    "C:",
]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_names(name: str) -> None:
    assert check_model_name(name) == name


@pytest.mark.parametrize("name", [*BAD_NAMES, None, 5, b"abc"])
def test_bad_names(name: object) -> None:
    with pytest.raises(ConfigError) as error:
        check_model_name(name)
    assert NAME_RULE in str(error.value)


@pytest.mark.parametrize(
    ("version", "canonical"), [("1", "1"), ("10", "10"), (3, "3"), ("9" * 18, "9" * 18)]
)
def test_good_versions(version: object, canonical: str) -> None:
    assert check_version(version) == canonical


@pytest.mark.parametrize(
    "version",
    ["", "0", "01", "007", "-1", "+1", "1.0", "1e3", " 1", "1\n", "\uff11", "\u0661", "9" * 19,
     "..", "1/2", "%31", 0, -3, True, 1.0, None],
)  # fmt: skip
def test_bad_versions(version: object) -> None:
    with pytest.raises(ConfigError) as error:
        check_version(version)
    assert VERSION_RULE in str(error.value)


# --- resolve_inside -----------------------------------------------------------------------------


def test_resolve_inside_plain_paths(repo: Path) -> None:
    hf_version(repo / "embed" / "1")
    assert resolve_inside(repo, "embed", "1") == (repo / "embed" / "1").resolve()
    assert resolve_inside(repo, "embed", "1", "config.json").is_file()
    assert resolve_inside(repo) == repo.resolve()


@pytest.mark.parametrize("part", [*BAD_NAMES, "/etc/passwd"])
def test_resolve_inside_refuses_bad_parts(repo: Path, part: str) -> None:
    (repo / "embed").mkdir()
    with pytest.raises(ConfigError):
        resolve_inside(repo, "embed", part)
    with pytest.raises(ConfigError):
        resolve_inside(repo, part)


def test_resolve_inside_follows_links_inside_the_repository(repo: Path) -> None:
    hf_version(repo / "embed" / "1")
    (repo / "alias").symlink_to(repo / "embed")
    (repo / "embed" / "2").symlink_to("1")
    assert resolve_inside(repo, "alias", "1") == (repo / "embed" / "1").resolve()
    assert resolve_inside(repo, "embed", "2") == (repo / "embed" / "1").resolve()


def test_resolve_inside_refuses_links_leaving_the_repository(repo: Path, outside: Path) -> None:
    (repo / "stolen").symlink_to(outside / "stolen_model")  # model dir
    hf_version(repo / "embed" / "1")
    (repo / "embed" / "9").symlink_to(outside / "9")  # version dir
    (repo / "embed" / "config.yaml").symlink_to(outside / "config.yaml")  # config file
    (repo / "embed" / "1" / "extra.safetensors").symlink_to(outside / "weights.safetensors")
    (repo / "embed" / "up").symlink_to("../..")  # relative, climbing out
    cases = [
        ("stolen",),
        ("stolen", "1"),
        ("embed", "9"),
        ("embed", "config.yaml"),
        ("embed", "1", "extra.safetensors"),
        ("embed", "up"),
    ]
    for parts in cases:
        with pytest.raises(ConfigError, match="leads outside the model repository") as error:
            resolve_inside(repo, *parts)
        assert str(repo.parent) not in str(error.value)  # no absolute path in the message


def test_resolve_inside_missing_and_looping(repo: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_inside(repo, "nothing")
    (repo / "loop").symlink_to("loop")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_inside(repo, "loop")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_inside(repo.parent / "no-repo", "x")


# --- scanning -----------------------------------------------------------------------------------


def test_scan_reads_models_versions_and_kinds(repo: Path) -> None:
    write(repo / "embed" / "config.yaml", EMBED_CONFIG)
    for version in ("1", "3", "10"):
        hf_version(repo / "embed" / version)
    (repo / "embed" / "old").mkdir()  # not a version: ignored
    (repo / "embed" / "checkpoints").mkdir()
    write(repo / "onnx-embed" / "config.json", '{"backend": "onnx"}')
    onnx_version(repo / "onnx-embed" / "1")
    write(repo / "README.md", "not a model")
    warnings = Warnings()
    entries = scan_repository(repo, warn=warnings)
    assert list(entries) == ["embed", "onnx-embed"]
    embed = entries["embed"]
    assert embed.error == "" and embed.config is not None
    assert embed.path == (repo / "embed").resolve()
    # latest 2 of 1, 3, 10 in numeric order (lexicographic would give 10 and 3's neighbour 1).
    assert list(embed.versions) == ["3", "10"]
    assert all(v.kind == "hf" and v.error == "" for v in embed.versions.values())
    assert embed.versions["10"].path == (repo / "embed" / "10").resolve()
    onnx = entries["onnx-embed"].versions["1"]
    assert onnx.kind == "onnx" and onnx.error == ""
    assert onnx.model_file == (repo / "onnx-embed" / "1" / "model.onnx").resolve()
    assert warnings == []


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("{latest: {num_versions: 1}}", ["10"]),
        ("{latest: {num_versions: 2}}", ["3", "10"]),
        ("all", ["1", "3", "10"]),
        ("{specific: {versions: [1, 10, 4]}}", ["1", "10"]),
    ],
)
def test_scan_applies_the_version_policy(repo: Path, policy: str, expected: list[str]) -> None:
    write(repo / "m" / "config.yaml", f"backend: embedding\nversion_policy: {policy}\n")
    for version in ("10", "1", "3"):
        hf_version(repo / "m" / version)
    assert list(scan_repository(repo)["m"].versions) == expected


def test_models_with_bad_configs_are_reported_not_dropped(repo: Path) -> None:
    write(repo / "broken" / "config.yaml", "backend: embedding\nmax_batch_size: 0\n")
    hf_version(repo / "broken" / "1")
    hf_version(repo / "broken" / "2")
    hf_version(repo / "noconfig" / "1")
    write(repo / "twice" / "config.yaml", "backend: onnx\n")
    write(repo / "twice" / "config.json", '{"backend": "onnx"}')
    entries = scan_repository(repo)
    broken = entries["broken"]
    assert broken.config is None
    assert broken.error.startswith("models/broken/config.yaml: max_batch_size:")
    assert list(broken.versions) == ["2"]  # the default policy: latest 1
    assert entries["noconfig"].error == "models/noconfig: no config.yaml, config.yml or config.json"
    assert "keep exactly one" in entries["twice"].error


def test_invalid_versions_are_kept_with_an_error(repo: Path) -> None:
    write(repo / "embed" / "config.yaml", "backend: embedding\nversion_policy: all\n")
    hf_version(repo / "embed" / "1")
    (repo / "embed" / "2").mkdir()  # empty
    write(repo / "embed" / "3" / "config.json", "{}")  # no weights
    onnx_version(repo / "embed" / "4")  # an onnx folder for a PyTorch backend
    write(repo / "onnx" / "config.yaml", "backend: onnx\nversion_policy: all\n")
    hf_version(repo / "onnx" / "1")
    write(repo / "onnx" / "2" / "a.onnx")
    write(repo / "onnx" / "2" / "b.onnx")
    write(repo / "onnx" / "3" / "b.onnx")
    write(repo / "onnx" / "3" / "model.onnx")
    write(repo / "dummy" / "config.yaml", "backend: llm\nllm: {load_format: dummy}\n")
    write(repo / "dummy" / "1" / "config.json", "{}")
    entries = scan_repository(repo)
    embed = entries["embed"].versions
    assert [embed[v].kind for v in ("1", "2", "3", "4")] == ["hf", None, None, None]
    assert embed["2"].error == "models/embed/2: no config.json and *.safetensors"
    assert embed["3"].error and embed["4"].error
    onnx = entries["onnx"].versions
    assert onnx["1"].error == "models/onnx/1: no .onnx file"
    assert "several .onnx files" in onnx["2"].error
    assert onnx["3"].kind == "onnx" and onnx["3"].model_file is not None
    assert onnx["3"].model_file.name == "model.onnx"
    assert entries["dummy"].versions["1"].kind == "hf"


def test_bad_names_in_the_tree_are_skipped_with_a_warning(repo: Path) -> None:
    for name in ("bad name", "a%2Fb", "caf\u00e9", "-x"):
        write(repo / name / "config.yaml", "backend: onnx\n")
        onnx_version(repo / name / "1")
    write(repo / ".git" / "config", "not a model")
    write(repo / "ok" / "config.yaml", "backend: onnx\nversion_policy: all\n")
    for version in ("1", "01", "0", "9" * 19):
        onnx_version(repo / "ok" / version)
    warnings = Warnings()
    entries = scan_repository(repo, warn=warnings)
    assert list(entries) == ["ok"]
    assert list(entries["ok"].versions) == ["1"]
    for name in ("bad name", "a%2Fb", "caf\\xe9", "-x", "'01'", "'0'"):
        assert warnings.mention(name), name
    assert not warnings.mention(".git")


def test_links_leaving_the_repository_are_never_followed(repo: Path, outside: Path) -> None:
    # A model folder, a version folder, a config file and a weight file, each a link out.
    (repo / "stolen").symlink_to(outside / "stolen_model")
    write(repo / "linkver" / "config.yaml", "backend: embedding\nversion_policy: all\n")
    hf_version(repo / "linkver" / "1")
    (repo / "linkver" / "9").symlink_to(outside / "9")
    (repo / "linkcfg").mkdir()
    (repo / "linkcfg" / "config.yaml").symlink_to(outside / "config.yaml")
    hf_version(repo / "linkcfg" / "1")
    write(repo / "linkweight" / "config.yaml", "backend: embedding\n")
    hf_version(repo / "linkweight" / "1")
    weight = repo / "linkweight" / "1" / "model-2.safetensors"
    weight.symlink_to(outside / "weights.safetensors")
    (repo / "linkweight" / "1" / "sub").symlink_to(outside)
    warnings = Warnings()
    entries = scan_repository(repo, warn=warnings)

    assert "stolen" not in entries
    assert warnings.mention("stolen: links outside the repository")
    assert list(entries["linkver"].versions) == ["1"]
    assert warnings.mention("9: links outside the repository")
    # The outside config.yaml is not valid YAML: had it been read, the error would say so.
    linkcfg = entries["linkcfg"]
    assert linkcfg.config is None
    assert linkcfg.error == "models/linkcfg/config.yaml links outside the repository; not followed"
    version = entries["linkweight"].versions["1"]
    assert version.kind is None
    assert "model-2.safetensors" in version.error and "sub" in version.error
    assert "not followed" in version.error
    # Nothing outside is part of the fingerprint: changing it changes nothing.
    before = version.fingerprint
    write(outside / "weights.safetensors", "different and longer secret weights")
    write(outside / "new-file", "y")
    assert scan_repository(repo)["linkweight"].versions["1"].fingerprint == before
    for text in (*warnings, linkcfg.error, version.error):
        assert str(repo.parent) not in text  # no absolute paths in messages


def test_links_inside_the_repository_are_followed(repo: Path) -> None:
    write(repo / "embed" / "config.yaml", "backend: embedding\nversion_policy: all\n")
    hf_version(repo / "embed" / "1")
    (repo / "embed" / "2").symlink_to("1")
    write(repo / "shared" / "big.safetensors", "shared weights")
    (repo / "embed" / "1" / "extra.safetensors").symlink_to(repo / "shared" / "big.safetensors")
    (repo / "alias").symlink_to("embed")
    warnings = Warnings()
    entries = scan_repository(repo, warn=warnings)
    assert entries["alias"].path == entries["embed"].path == (repo / "embed").resolve()
    assert list(entries["embed"].versions) == ["1", "2"]
    assert entries["embed"].versions["2"].path == (repo / "embed" / "1").resolve()
    assert entries["embed"].versions["1"].kind == "hf"
    assert warnings == []


def test_broken_and_looping_links_are_skipped(repo: Path) -> None:
    (repo / "gone").symlink_to(repo / "nowhere")
    (repo / "loop").symlink_to("loop")
    write(repo / "m" / "config.yaml", "backend: onnx\n")
    onnx_version(repo / "m" / "1")
    (repo / "m" / "1" / "self").symlink_to("self")
    warnings = Warnings()
    entries = scan_repository(repo, warn=warnings)
    assert list(entries) == ["m"]
    assert warnings.mention("gone: broken link") and warnings.mention("loop: broken link")
    assert "self" in entries["m"].versions["1"].error


def test_fingerprint_changes_when_files_are_replaced(repo: Path) -> None:
    write(repo / "m" / "config.yaml", "backend: embedding\n")
    version = hf_version(repo / "m" / "1")

    def fingerprint() -> str:
        return scan_repository(repo)["m"].versions["1"].fingerprint

    first = fingerprint()
    assert fingerprint() == first  # stable while nothing changes
    weights = version / "model.safetensors"
    stat = weights.stat()
    # Replaced by a file of the same size and mtime (a copy with -p, then a rename).
    write(version / "tmp", "WEIGHTS")
    os.utime(version / "tmp", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(version / "tmp", weights)
    second = fingerprint()
    assert second != first
    write(version / "tokenizer.json", "{}")
    third = fingerprint()
    assert third not in (first, second)
    (version / "tokenizer.json").unlink()
    assert fingerprint() == second


def test_a_missing_repository_is_an_error_not_an_empty_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        scan_repository(tmp_path / "models")
    write(tmp_path / "file", "x")
    with pytest.raises(ConfigError, match="not a directory"):
        scan_repository(tmp_path / "file")


def test_the_repository_root_may_be_a_link(tmp_path: Path, repo: Path) -> None:
    write(repo / "m" / "config.yaml", "backend: onnx\n")
    onnx_version(repo / "m" / "1")
    (tmp_path / "current").symlink_to(repo)
    assert scan_repository(tmp_path / "current")["m"].versions["1"].kind == "onnx"
