"""The linear kernel on each GGUF type it keeps in blocks, against fp32 in the same run.

    python bench/gguf_types.py [--rows 1,64] [--shape 8192x2048]

One weight of Llama-3.2-1B's MLP shape (8192 x 2048 by default) in each type: quantized by
gguf-py where it can, else (K-quants) random blocks with a small fp16 scale, which run the
same instructions. For 1 and 64 rows of activations, medians over rounds that take each
type in turn, exact (--dtype gguf) and, where it runs, with 8-bit activations (gguf-int8):
GFLOP/s and its share of the cores' peak (fp32 FMA, or int8 products for gguf-int8; both
measured in this run), the packed weight's bytes per weight and GB/s streamed, the ratio to
the fp32 kernel on the same weights, and the matmul peak torch's GEMM reaches in this run.
F16 is the 16-bit panels F16 and BF16 tensors stay in. --variant avx2 times the AVX2 build
of the kernel (what AVX2-only CPUs run) against the cores' AVX2 peaks.
"""

import argparse
import statistics
import time

from common import (
    checked_peak,
    fma_peak_gflops,
    int8_peak_gops,
    machine_line,
    matmul_peak_gflops,
)

# isort: split
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvfence.model.kernels import build, cpu_variant
from kvfence.model.linear import pack, pack_for_int8
from kvfence.model.quant import BLOCK_BYTES, INT8_BLOCK_TYPES, gguf_blocks


def blocks_of(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    qtype = GGMLQuantizationType[kind]
    if not kind.endswith("_K"):
        return quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    # Q4_K/Q5_K: d and dmin first; Q6_K: d last
    at, count = (size - 2, 1) if kind == "Q6_K" else (0, 2)
    raw[..., at : at + 2 * count] = np.full((n, k // block, count), 1e-4, np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64", help="activation rows, comma-separated")
    ap.add_argument("--shape", default="8192x2048", help="output x input features")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20, help="calls timed per round")
    ap.add_argument(
        "--variant", choices=["avx512", "avx2"], default=None, help="kernel build (this CPU's)"
    )
    args = ap.parse_args()
    n, k = map(int, args.shape.split("x"))
    rows = [int(r) for r in args.rows.split(",")]
    variant = args.variant or cpu_variant()
    module = build("linear", variant) if variant else None
    if module is None:
        raise SystemExit("the linear kernel is not installed here: nothing to measure")
    kernel = module.packed_linear
    march = "x86-64-v3" if variant == "avx2" else "native"
    rng = np.random.default_rng(0)
    weights = {}
    for kind in BLOCK_BYTES:
        raw = blocks_of(kind, n, k, rng)
        weights[kind] = pack(gguf_blocks(raw, kind))
        if kind in INT8_BLOCK_TYPES:  # --dtype gguf-int8's layout and arithmetic
            weights[f"{kind} int8"] = pack_for_int8(gguf_blocks(raw, kind))
        if kind == "Q4_0":  # fp32 on the same values, for the ratio
            fp32 = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_0))
            weights["F32"], weights["F16"] = pack(fp32), pack(fp32.half())
    xs = {m: torch.randn(m, k) for m in rows}
    times = {(kind, m): [] for kind in weights for m in rows}
    for _ in range(args.rounds):
        for kind, packed in weights.items():
            for m, x in xs.items():
                kernel(x, packed, n, None)
                t = time.perf_counter()
                for _ in range(args.repeats):
                    kernel(x, packed, n, None)
                times[kind, m].append((time.perf_counter() - t) / args.repeats)
    rates = {key: 2 * key[1] * n * k / statistics.median(t) / 1e9 for key, t in times.items()}
    peak = matmul_peak_gflops()
    best_fp = max([peak] + [r for (kind, _), r in rates.items() if "int8" not in kind])
    best_int8 = max(r for (kind, _), r in rates.items() if "int8" in kind)
    peaks = {
        False: checked_peak(fma_peak_gflops(march=march), best_fp, "fp32 FMA", "a GEMM"),
        True: checked_peak(int8_peak_gops(march=march), best_int8, "int8", "the int8 kernel"),
    }
    print(
        f"machine: {machine_line()}; kernel {variant}; weight {n} x {k}; "
        f"medians of {args.rounds} rounds"
    )
    print(f"fp32 matmul peak measured (torch GEMM): {peak:.1f} GFLOP/s")
    for int8, name in ((False, "fp32 FMA"), (True, "int8 product")):
        if peaks[int8]:
            print(f"{name} peak of the cores (independent chains): {peaks[int8]:.1f} G/s")
    print(
        "| type | bytes/weight | "
        + " | ".join(f"{m} rows: GFLOP/s (% of peak), GB/s, x fp32" for m in rows)
        + " |"
    )
    print("|---|---|" + "---|" * len(rows))
    for kind, packed in weights.items():
        per_weight = packed.numel() * packed.element_size() / (n * k)
        cells = []
        for m in rows:
            s = statistics.median(times[kind, m])
            fp32 = statistics.median(times["F32", m])
            of_peak = peaks["int8" in kind]
            share = f" ({100 * rates[kind, m] / of_peak:.0f}%)" if of_peak else ""
            cells.append(
                f"{rates[kind, m]:.1f}{share}, {per_weight * n * k / s / 1e9:.1f}, {fp32 / s:.2f}"
            )
        print(f"| {kind} | {per_weight:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
