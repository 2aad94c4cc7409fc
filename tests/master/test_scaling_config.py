"""Bad elastic settings are refused at start, each with a message naming the setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hio.config import ConfigError
from hio.master.config import MasterConfig
from tests.harness import hio_env


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"scaling": "auto"}, "scaling"),
        ({"lower_rate": -1.0}, "lower_rate"),
        ({"upper_rate": -5.0}, "upper_rate"),
        ({"lower_rate": 6.0}, "lower_rate"),  # above upper_rate
        ({"slowdown_rate": 2.0}, "slowdown_rate"),
        ({"queue_limit": -1}, "queue_limit"),
        ({"cooldown_seconds": -10.0}, "cooldown_seconds"),
        ({"engine_idle_seconds": 0.0}, "engine_idle_seconds"),
        ({"large_step": 0}, "large_step"),
        ({"small_step": 3}, "small_step"),  # above large_step
        ({"default_share": -0.1}, "default_share"),
        ({"profile_seconds": float("nan")}, "profile_seconds"),
        ({"scaling": "elastic", "min_workers": 3, "max_workers": 2}, "min_workers"),
        ({"scaling": "elastic", "min_workers": -1}, "min_workers"),
        ({"scaling": "elastic", "max_workers": 0}, "max_workers"),
        ({"scaling": "elastic", "provisioner": "kubernetes"}, "provisioner"),
        ({"provisioner": "local"}, "provisioner"),  # fixed sizing has nothing to provision for
        ({"scaling": "elastic", "pack_margin": 0.95}, "pack_margin"),
        ({"scaling": "elastic", "worker_cpus": -2}, "worker_cpus"),
        ({"scaling": "elastic", "worker_grace_seconds": -1.0}, "worker_grace_seconds"),
        ({"scaling": "elastic", "worker_prefix": "a/b"}, "worker_prefix"),
        ({"scaling": "elastic", "advertise_address": "nohost"}, "advertise_address"),
    ],
)
def test_bad_scaling_settings_are_refused_naming_the_setting(
    tmp_path: Path, overrides: dict[str, object], named: str
) -> None:
    config = MasterConfig(data_dir=str(tmp_path), **overrides)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=named):
        config.validate()


def test_hio_master_refuses_a_bad_setting_before_it_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hio.cli",
            "master",
            "--data-dir",
            str(tmp_path),
            "--scaling",
            "elastic",
            "--lower-rate",
            "-1",
        ],
        env=hio_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "lower_rate" in done.stderr


def test_a_provisioner_in_a_cluster_with_tokens_needs_a_worker_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("secret admin operator\n")
    config = MasterConfig(data_dir=str(tmp_path), scaling="elastic", provisioner="local", tokens_file=str(tokens))
    with pytest.raises(ConfigError, match="worker_token_file"):
        config.validate()


def test_hio_master_refuses_min_workers_above_max_workers(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hio.cli",
            "master",
            "--data-dir",
            str(tmp_path),
            "--scaling",
            "elastic",
            "--provisioner",
            "local",
            "--min-workers",
            "5",
            "--max-workers",
            "2",
        ],
        env=hio_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "min_workers (5) must not exceed max_workers (2)" in done.stderr


def test_hio_master_refuses_an_option_its_provisioner_does_not_have(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hio.cli",
            "master",
            "--data-dir",
            str(tmp_path),
            "--listen",
            "127.0.0.1:0",
            "--scaling",
            "elastic",
            "--provisioner",
            "local",
            "--provisioner-options",
            "flavor=large",
        ],
        env=hio_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "provisioner_options" in done.stderr and "flavor" in done.stderr
