"""Shared pieces of the benchmarks: the seeded workload, the matmul peak, the machine line."""

import platform
import random
import statistics
import sys
import time
from functools import partial

from kvfence import SamplingParams  # before torch: it sets libgomp's wait as torch loads it

# isort: split
import torch


def machine_line(device: str = "cpu") -> str:
    cpu = platform.processor() or "unknown cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    line = f"{cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    return line + (f", {torch.cuda.get_device_name(device)}" if device.startswith("cuda") else "")


def mixed_workload(
    num_requests: int, seed: int, vocab: int = 49152, prompt=(32, 512), output=(32, 256)
):
    """(prompt token ids, output length) pairs; token ids avoid the first 100 (special) ids."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab) for _ in range(rng.randint(*prompt))],
            rng.randint(*output),
        )
        for _ in range(num_requests)
    ]


def median_seconds(run, sync, repeats: int) -> float:
    """Median wall time of run() over `repeats` calls, each between two sync() calls."""
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_peak_gflops(
    repeats: int = 20, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> float:
    """Best GFLOP/s over a few GEMM shapes of this model's size and larger (fp32 unless told)."""
    best = 0.0
    with torch.inference_mode():
        for m, k, n in [(1024, 576, 1536), (2048, 2048, 2048), (512, 576, 49152 // 4)]:
            a, b = (
                torch.randn(m, k, dtype=dtype, device=device),
                torch.randn(k, n, dtype=dtype, device=device),
            )
            sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
            for _ in range(3):
                torch.matmul(a, b)
            seconds = median_seconds(partial(torch.matmul, a, b), sync, repeats)
            best = max(best, 2 * m * n * k / seconds / 1e9)
    return best


FMA_LOOP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
#else
typedef float vec __attribute__((vector_size(32)));
#endif
constexpr int kChains = 12;  // independent multiply-adds in flight: more than latency x pipes
// Every thread runs `iterations` rounds of kChains vector FMAs; returns the FLOPs done.
double fma_loop(int64_t iterations) {
  const int threads = at::get_num_threads();
  std::vector<float> sink(threads);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      vec acc[kChains], a, b;
      for (int i = 0; i < kChains; ++i) acc[i] = vec{} + (1.f + static_cast<float>(i));
      a = vec{} + 0.999999f;
      b = vec{} + 1e-7f;
      for (int64_t n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
        for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * a + b;  // one FMA each, in registers
      }
      for (int i = 1; i < kChains; ++i) acc[0] += acc[i];
      sink[t] = acc[0][0];
    }
  });
  volatile float keep = sink[0];
  (void)keep;
  return 2.0 * kChains * (sizeof(vec) / sizeof(float)) * iterations * threads;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fma_loop", &fma_loop); }
"""


def fma_peak_gflops(repeats: int = 5) -> float | None:
    """The cores' own fp32 peak: every thread runs independent chains of vector fused
    multiply-adds, the widest the CPU has (compiled here with -march=native). On AMD CPUs
    MKL's GEMM, which matmul_peak_gflops times, reaches well under half of it. None where
    the loop cannot be compiled."""
    from torch.utils.cpp_extension import load_inline

    flags = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
    try:
        module = load_inline(
            "kvfence_bench_fma",
            FMA_LOOP,
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler or ninja: the report leaves this peak out
        print(f"fp32 FMA peak not measured: the loop did not build ({e})", file=sys.stderr)
        return None
    module.fma_loop(1_000_000)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        flops = module.fma_loop(20_000_000)
        rates.append(flops / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


def read_bandwidth_gbs(megabytes: int = 400, repeats: int = 10, device: str = "cpu") -> float:
    """GB/s of streaming a tensor far larger than the caches once (a sum over it), median."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    x.sum()
    return x.numel() * 4 / median_seconds(x.sum, sync, repeats) / 1e9


def flops_per_token(cfg, with_lm_head: bool = True) -> float:
    """Matmul FLOPs of one token through the model (attention scores excluded)."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = (
        h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        + cfg.num_heads * d * h
        + 3 * h * cfg.intermediate_size
    )
    total = cfg.num_layers * per_layer + (cfg.vocab_size * h if with_lm_head else 0)
    return 2.0 * total


def run_kvfence(llm, workload, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Submits (prompt ids, output length) pairs at once (greedy unless a temperature is
    given; EOS ignored) and steps the engine until all finish. Also times generation alone:
    the steps once every prompt is in.
    The prefix cache starts empty, so that a workload run again is not served from it."""
    engine = llm.engine
    if engine.prefix_cache is not None:
        engine.prefix_cache.evict(engine.prefix_cache.num_evictable)
    for prompt, out_len in workload:
        engine.add_request(
            prompt,
            SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_tokens=out_len,
                ignore_eos=True,
            ),
        )
    generated, generation_tokens, generation_s = 0, 0, 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        generating = not engine.scheduler.waiting and all(
            r.output_token_ids for r in engine.scheduler.running
        )
        t = time.perf_counter()
        tokens = sum(len(o.delta_token_ids) for o in engine.step())
        generated += tokens
        if generating:
            generation_s += time.perf_counter() - t
            generation_tokens += tokens
    elapsed = time.perf_counter() - start
    return {
        "requests": len(workload),
        "output_tokens": generated,
        "seconds": elapsed,
        "tok_s": generated / elapsed,
        "generation_tok_s": generation_tokens / generation_s if generation_s else None,
    }
