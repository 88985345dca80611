"""Shared test setup. `tests/` is put on sys.path so tests import helpers as `fixtures.*`."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# Keep tests reproducible and within the 2 cores CI has.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
