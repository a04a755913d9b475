"""`--ray` settings without a cluster: bare `--ray`, the flags onto Ray Serve's deployment
options, the exclusions, and the install hint when Ray is missing."""

from __future__ import annotations

import sys

import pytest

from qiao.api.settings import load_settings
from qiao.engine.ray_replicas import INSTALL_HINT, RayOptions, affinity_key, require_ray
from qiao.errors import ConfigError


def test_bare_ray_means_local_and_an_address_is_kept() -> None:
    assert load_settings(["--ray"]).ray_options().address == "local"
    assert load_settings(["--ray", "--replicas", "3"]).ray_options().replicas == 3
    assert load_settings(["--ray", "10.0.0.5:6379"]).ray_options().address == "10.0.0.5:6379"
    assert load_settings([]).ray_options() is None


def test_fixed_replicas_or_autoscaling_become_ray_serve_options() -> None:
    fixed = RayOptions(replicas=2).deployment_options()
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    options = load_settings(
        ["--ray", "--ray-max-replicas", "4", "--ray-min-replicas", "2", "--ray-upscale-delay", "3"]
    ).ray_options()
    scaling = options.deployment_options()["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (2, 4)
    assert scaling["initial_replicas"] == 2 and scaling["upscale_delay_s"] == 3.0
    assert "num_replicas" not in options.deployment_options()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ray", "--data-parallel-size", "2"], "exclude each other"),
        (["--ray", "--in-process-engine"], "exclude each other"),
        (["--ray", "--ray-max-replicas", "1", "--ray-min-replicas", "2"], "must not exceed"),
    ],
)
def test_conflicting_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(argv)


def test_affinity_key_covers_the_first_tokens_only() -> None:
    assert affinity_key([1, 2, 3], 4) is None
    assert affinity_key([1, 2, 3, 4, 5], 4) == affinity_key([1, 2, 3, 4, 9], 4)
    assert affinity_key([1, 2, 3, 4, 5], 4) != affinity_key([1, 2, 3, 7, 5], 4)
    assert affinity_key([1, 2, 3, 4], 0) is None


def test_without_ray_the_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match="pip install 'qiao\\[ray\\]'") as info:
        require_ray()
    assert INSTALL_HINT in str(info.value)
