"""A pipeline whose import fails, as a user's typo would."""

import hio_no_such_module  # noqa: F401 - the import failing is the point


def process(data, info):  # type: ignore[no-untyped-def]
    return {}
