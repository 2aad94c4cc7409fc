"""A pipeline module without setup() or KD_FEATURES."""


def process(data: bytes, info):  # type: ignore[no-untyped-def]
    return {"length": len(data)}


NOT_CALLABLE = 3
