"""The CPU decode-attention kernel (csrc/paged_attention.cpp), compiled on first use."""
import functools
import logging
import os
from pathlib import Path

log = logging.getLogger("kvfence.kernels")


@functools.cache
def cpu_attention_kernel():
    """The compiled kernel, or None where it cannot be built (no C++ compiler or ninja);
    decode attention then gathers pages in PyTorch, which is correct but slower."""
    try:
        import ninja
        from torch.utils.cpp_extension import load

        # torch looks for ninja on PATH, which an unactivated virtualenv lacks.
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        module = load(name="kvfence_paged_attention", sources=[str(Path(__file__).parent / "csrc" / "paged_attention.cpp")],
                      extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - any build failure means the PyTorch path
        log.warning("CPU attention kernel unavailable, decode attention gathers pages in PyTorch: %s", e)
        return None
    return module.paged_decode_attention


def decode_kernel(attention: str, device: str):
    """The kernel to use for `--attention` on `device`; None means the PyTorch path."""
    if attention == "torch" or device != "cpu":
        return None
    kernel = cpu_attention_kernel()
    if kernel is None and attention == "kernel":
        raise RuntimeError("--attention kernel was asked for but the kernel did not build (see the warning above)")
    return kernel
