"""Batch invariance: a sequence's logits at a position are bitwise the same whatever else the
step holds (issue 28).

Dense float32 forms are tested in the default mode. The encoded forms (GGUF block types,
F16 / BF16 rows, bf16 / fp16 checkpoints) run linear kernels whose summation order follows a
call's row count by default, and are tested with `--batch-invariant`
(fixtures/invariance.knobs), the guarantee that flag gives.
"""

from __future__ import annotations

import pytest

from iterserve.model import kernels


@pytest.fixture(autouse=True)
def _kernel_config_restored():
    """Tests here switch the process's kernel configuration; the next test starts from the
    one it found."""
    before = kernels.config()
    yield
    kernels.configure(before)
