"""The CPU kernels of csrc/, built at install by setup.py for AVX2 and AVX-512: the widest
build this CPU runs is loaded, and nothing compiles at run time."""

import functools
import importlib
import logging

log = logging.getLogger("kvfence.kernels")

VARIANTS = ("avx512", "avx2")  # widest first
# What runs instead of each kernel where it is missing: the warning names what is slower.
FALLBACKS = {
    "paged_attention": "attention gathers the KV pages in PyTorch",
    "linear": "linear layers run torch's matmul on float32 weights (no --dtype gguf)",
    "fused": "the row ops and the greedy pick run as several PyTorch ops",
}


@functools.cache
def cpu_variant() -> str | None:
    """The widest kernel build this CPU runs (by CPUID), or None: not an x86-64 CPU with AVX2,
    or kvfence was installed without a C++ compiler."""
    try:
        cpu = importlib.import_module("kvfence.model._ext.cpu")
    except ImportError:
        return None
    return next((v for v in VARIANTS if cpu.supports(v)), None)


@functools.cache
def build(name: str, variant: str | None = None):
    """The installed module of csrc/{name}.cpp for `variant` (default: this CPU's), or None,
    with a warning saying what runs slower instead; callers then take the PyTorch path. The
    tests load the AVX2 build on AVX-512 CPUs too."""
    variant = variant or cpu_variant()
    if variant is None:
        log.warning(
            "no CPU kernels for this CPU or this install (kvfence was installed without a C++ "
            "compiler, or the CPU lacks AVX2): %s",
            FALLBACKS[name],
        )
        return None
    try:
        return importlib.import_module(f"kvfence.model._ext.{name}_{variant}")
    except ImportError as e:  # not built at install, or built against another torch
        log.warning("CPU kernel %s_%s unavailable (%s): %s", name, variant, e, FALLBACKS[name])
        return None


def decode_kernel(attention: str, device: str):
    """The decode-attention kernel to use for `--attention` on `device`; None means the
    PyTorch path (gathers pages: correct but slower)."""
    if attention == "torch" or device != "cpu":
        return None
    module = build("paged_attention")
    if module is None and attention == "kernel":
        raise RuntimeError(
            "--attention kernel was asked for but the kernel is not installed (see the warning)"
        )
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
    return functools.partial(
        fused.DecodeLayers, linear.packed_linear_fn, attention.paged_decode_attention_fn
    )


def linear_kernel(device: str):
    """The packed linear kernel for `device`, or None (GPU, or no kernel: torch's matmul)."""
    if device != "cpu":
        return None
    module = build("linear")
    return None if module is None else module.packed_linear


def packed_rows_kernel(device: str):
    """Rows of a linear kernel's packed blocks as fp32 (a tied embedding's lookup from the
    output layer's weights), or None where that kernel is missing."""
    if device != "cpu":
        return None
    module = build("linear")
    return None if module is None else module.packed_rows
