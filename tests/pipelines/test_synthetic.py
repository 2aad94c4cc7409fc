"""The synthetic benchmark pipeline: real CPU cost, verifiable output."""

from __future__ import annotations

import time
import zlib

import pytest

from hio.worker.pipelines import synthetic
from tests.pipelines.conftest import Info, with_attributes


def test_burn_cpu_uses_requested_thread_time() -> None:
    before = time.thread_time()
    reported = synthetic.burn_cpu(0.2)
    used = time.thread_time() - before
    assert used >= 0.9 * 0.2
    assert reported >= 0.2
    assert synthetic.burn_cpu(0.0) == 0.0


def test_process_burns_cost_ms() -> None:
    before = time.thread_time()
    synthetic.process(b"x" * 100, with_attributes(cost_ms="150"))
    assert time.thread_time() - before >= 0.9 * 0.150


def test_output_is_verifiable_and_sized(info: Info) -> None:
    payload = bytes(range(256)) * 64  # 16 KiB: the CRC covers only the first 4 KiB
    features = synthetic.process(payload, info)
    assert features["size_bytes"] == float(len(payload))
    assert features["crc32_head"] == float(zlib.crc32(payload[:4096]))
    assert sorted(k for k in features if k.startswith("f")) == ["f0", "f1", "f2", "f3"]
    assert set(synthetic.KD_FEATURES) <= set(features)
    assert all(0.0 <= features[f"f{i}"] < 1.0 for i in range(4))
    many = synthetic.process(payload, with_attributes(features="50"))
    assert sum(k.startswith("f") for k in many) == 50
    assert [many[f"f{i}"] for i in range(4)] == [features[f"f{i}"] for i in range(4)]
    none = synthetic.process(payload, with_attributes(features="0"))
    assert set(none) == {"size_bytes", "crc32_head"}


def test_deterministic_and_payload_dependent(info: Info) -> None:
    a, b = b"a" * 1000, b"b" * 1000
    assert synthetic.process(a, info) == synthetic.process(a, info)
    assert synthetic.process(a, info)["f0"] != synthetic.process(b, info)["f0"]
    assert synthetic.process(a, info)["f0"] != synthetic.process(a + b"a", info)["f0"]


@pytest.mark.parametrize(
    "attributes, name",
    [
        ({"cost_ms": "-1"}, "cost_ms"),
        ({"cost_ms": "soon"}, "cost_ms"),
        ({"cost_ms": "inf"}, "cost_ms"),
        ({"features": "1.5"}, "features"),
        ({"features": str(synthetic.MAX_FEATURES + 1)}, "features"),
    ],
)
def test_bad_attributes_are_named(attributes: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"attribute {name}="):
        synthetic.process(b"data", Info(attributes=attributes))
