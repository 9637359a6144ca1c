"""Tests marked ``hf`` compare with ``transformers`` live: skipped, saying how to run them,
where it is not installed (the default ``test`` extra leaves out transformers and torch).
``interop/conftest.py`` and ``models/conftest.py`` install this hook."""

from importlib.util import find_spec

import pytest

HF_MISSING = find_spec("transformers") is None or find_spec("torch") is None


def pytest_runtest_setup(item):
    if HF_MISSING and item.get_closest_marker("hf"):
        pytest.skip('needs transformers and torch: pip install -e ".[hf]", then pytest -m hf')
