"""The TensorFlow and Keras frontends' tests: real TensorFlow and Keras, real jobs.

``make test`` installs TensorFlow, Keras and tf_keras (the ``tensorflow`` and ``keras``
extras); where they are missing, these tests are skipped with the reason."""

from __future__ import annotations

import importlib.util

import pytest

MISSING = [
    name for name in ("tensorflow", "keras", "tf_keras") if importlib.util.find_spec(name) is None
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not MISSING:
        return
    skip = pytest.mark.skip(
        reason=f"{', '.join(MISSING)} not installed (pip install -e '.[tensorflow,keras]')"
    )
    for item in items:
        if "tests/frameworks/" in str(item.fspath):
            item.add_marker(skip)
