"""A pipeline whose setup() raises, as a missing calibration file would."""


def setup() -> None:
    raise RuntimeError("no calibration file at /data/calibration.npz")


def process(data, info):  # type: ignore[no-untyped-def]
    return {}
