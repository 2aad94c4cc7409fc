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
