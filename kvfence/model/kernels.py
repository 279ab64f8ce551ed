"""The CPU kernels in csrc/, compiled on first use."""
import functools
import logging
import os
from pathlib import Path

log = logging.getLogger("kvfence.kernels")

# -ffast-math lets exp and the reductions vectorize; the linear kernel's sums must keep their order.
FAST_MATH = {"fused": True, "linear": False, "paged_attention": True}


@functools.cache
def build(name: str, march: str = "native"):
    """The compiled module csrc/{name}.cpp, or None where it cannot be built (no C++
    compiler, no ninja, neither AVX-512 nor AVX2 with FMA for `linear`); the callers then fall back to PyTorch.
    `march` other than native builds for an older instruction set (the tests run AVX2 code on AVX-512 CPUs)."""
    try:
        import ninja
        from torch.utils.cpp_extension import load

        # torch looks for ninja on PATH, which an unactivated virtualenv lacks.
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        flags = ["-O3", f"-march={march}", "-fopenmp"] + (["-ffast-math"] if FAST_MATH[name] else [])
        suffix = "" if march == "native" else "_" + march.replace("-", "_")
        return load(name=f"kvfence_{name}{suffix}", sources=[str(Path(__file__).parent / "csrc" / f"{name}.cpp")],
                    extra_cflags=flags, extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - any build failure means the PyTorch path
        log.warning("CPU kernel %s unavailable, falling back to PyTorch: %s", name, e)
        return None


def decode_kernel(attention: str, device: str):
    """The decode-attention kernel to use for `--attention` on `device`; None means the
    PyTorch path (gathers pages: correct but slower)."""
    if attention == "torch" or device != "cpu":
        return None
    module = build("paged_attention")
    if module is None and attention == "kernel":
        raise RuntimeError("--attention kernel was asked for but the kernel did not build (see the warning above)")
    return None if module is None else module.paged_decode_attention


def fused_ops(device: str):
    """The row ops of csrc/fused.cpp for `device`, or None (GPU, or no compiler: the
    PyTorch ops in model/llama.py and torch.argmax)."""
    return None if device != "cpu" else build("fused")


def decode_layers(device: str):
    """fused.cpp's DecodeLayers bound to the linear and attention kernels it calls: given a
    model's weights, a decode step's layers in one call from Python. None on a GPU or where a
    kernel is missing."""
    if device != "cpu":
        return None
    modules = build("fused"), build("linear"), build("paged_attention")
    if None in modules:
        return None
    fused, linear, attention = modules
    return functools.partial(fused.DecodeLayers, linear.packed_linear_fn, attention.paged_decode_attention_fn)


def linear_kernel(device: str):
    """The packed linear kernel for `device`, or None (GPU, or no kernel: torch's matmul)."""
    if device != "cpu":
        return None
    module = build("linear")
    return None if module is None else module.packed_linear
