"""Skip ``hf`` tests where transformers is missing (``tests/hf_skip.py``)."""

from hf_skip import pytest_runtest_setup  # noqa: F401
