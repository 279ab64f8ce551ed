"""Shared pieces of the benchmarks: the seeded workload, the matmul peak, the machine line."""

import platform
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

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


PEAK_LOOPS = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
#else
typedef float vec __attribute__((vector_size(32)));
#endif
// Every thread runs `iterations` rounds of `Chains` independent vector FMAs, all in registers
// (AVX2 has 16 vector registers: 14 chains, a and b fit); returns the FLOPs done.
template <int Chains>
double fma_chains(int64_t iterations, int threads) {
  std::vector<float> sink(threads);
#pragma omp parallel num_threads(threads)
  {
    vec acc[Chains], a = vec{} + 0.999999f, b = vec{} + 1e-7f;
    for (int i = 0; i < Chains; ++i) acc[i] = vec{} + (1.f + static_cast<float>(i));
    for (int64_t n = 0; n < iterations; ++n) {
#pragma GCC unroll 16
      for (int i = 0; i < Chains; ++i) acc[i] = acc[i] * a + b;
    }
    for (int i = 1; i < Chains; ++i) acc[0] += acc[i];
    sink[omp_get_thread_num()] = acc[0][0];
  }
  volatile float keep = sink[0];
  (void)keep;
  return 2.0 * Chains * (sizeof(vec) / sizeof(float)) * iterations * threads;
}
// The same with the int8 products the linear kernel's 8-bit activations use: vpdpbusd
// (AVX-512 VNNI, 64 byte products a vector), else vpmaddubsw, vpmaddwd and vpaddd (32).
// Returns the operations done, a multiply and an add per byte product.
template <int Chains>
double dot_chains(int64_t iterations, int threads) {
  std::vector<int> sink(threads);
#if defined(__AVX512VNNI__)
  using ivec = __m512i;
  auto bytes = [](int b) { return _mm512_set1_epi8(static_cast<char>(b)); };
  auto dot = [](ivec acc, ivec u, ivec s) { return _mm512_dpbusd_epi32(acc, u, s); };
  auto first = [](ivec v) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(v)); };
#else
  using ivec = __m256i;
  auto bytes = [](int b) { return _mm256_set1_epi8(static_cast<char>(b)); };
  auto dot = [](ivec acc, ivec u, ivec s) {
    const ivec pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  };
  auto first = [](ivec v) { return _mm_cvtsi128_si32(_mm256_castsi256_si128(v)); };
#endif
#pragma omp parallel num_threads(threads)
  {
    ivec acc[Chains], s = bytes(-2);
    for (int i = 0; i < Chains; ++i) acc[i] = bytes(i);
    for (int64_t n = 0; n < iterations; ++n) {
      // Each chain's own bytes as the unsigned codes: products shared between chains would be
      // computed once (AVX2's vpmaddubsw does not take the sums).
#pragma GCC unroll 16
      for (int i = 0; i < Chains; ++i) acc[i] = dot(acc[i], acc[i], s);
    }
    int total = 0;
    for (int i = 0; i < Chains; ++i) total += first(acc[i]);
    sink[omp_get_thread_num()] = total;
  }
  volatile int keep = sink[0];
  (void)keep;
  return 2.0 * Chains * sizeof(ivec) * iterations * threads;
}
template <int Chains>
double loop(bool int8, int64_t iterations, int threads) {
  return int8 ? dot_chains<Chains>(iterations, threads) : fma_chains<Chains>(iterations, threads);
}
double peak_loop(bool int8, int64_t iterations, int threads, int chains) {
  switch (chains) {
    case 8: return loop<8>(int8, iterations, threads);
    case 10: return loop<10>(int8, iterations, threads);
    case 12: return loop<12>(int8, iterations, threads);
    case 14: return loop<14>(int8, iterations, threads);
    default: TORCH_CHECK(false, "chains must be 8, 10, 12 or 14");
  }
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("peak_loop", &peak_loop); }
"""


def _loop_peak(int8: bool, repeats: int, march: str) -> float | None:
    """The best median rate (G operations/s) of PEAK_LOOPS' loop over 8 to 14 chains, on
    every thread (torch's thread count, each its own OpenMP thread), compiled here with
    -march={march}; None where it cannot be compiled."""
    from torch.utils.cpp_extension import load_inline

    flags = ["-O3", f"-march={march}", "-ffp-contract=fast", "-fopenmp"]
    try:
        module = load_inline(
            f"kvfence_bench_peak_loops_{march.replace('-', '_')}",
            PEAK_LOOPS,
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler or ninja: the report leaves this peak out
        print(f"peak not measured: the loop did not build ({e})", file=sys.stderr)
        return None
    threads = torch.get_num_threads()
    best = 0.0
    for chains in (8, 10, 12, 14):
        module.peak_loop(int8, 1_000_000, threads, chains)
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            ops = module.peak_loop(int8, 20_000_000, threads, chains)
            rates.append(ops / (time.perf_counter() - t) / 1e9)
        best = max(best, statistics.median(rates))
    return best


def fma_peak_gflops(repeats: int = 5, march: str = "native") -> float | None:
    """The cores' own fp32 peak: independent chains of vector fused multiply-adds, the widest
    the CPU has (march x86-64-v3: AVX2's). The chain count that covers FMA latency times
    pipes differs between cores, so the best of 8 to 14 counts. On AMD CPUs MKL's GEMM, which
    matmul_peak_gflops times, reaches well under half of it. None where the loop cannot be
    compiled."""
    return _loop_peak(False, repeats, march)


def int8_peak_gops(repeats: int = 5, march: str = "native") -> float | None:
    """The cores' peak on the int8 products --dtype gguf-int8 computes with (vpdpbusd with
    AVX-512 VNNI, else, or with march x86-64-v3, AVX2's vpmaddubsw + vpmaddwd + vpaddd), in
    G operations/s, two a byte product, as GFLOP/s count an FMA; None where the loop cannot
    be compiled."""
    return _loop_peak(True, repeats, march)


def checked_peak(peak: float | None, measured: float, name: str, by: str) -> float | None:
    """A peak (`name`, fp32 FMA or int8), or None where it reads below a rate measured in the
    same run (`by`): no program runs faster than the cores' peak, so such a reading is a
    faulty measurement, and every "% of the peak" computed from it would be wrong."""
    if peak is not None and peak < measured:
        print(
            f"{name} peak refused: it read {peak:.1f} G/s, below the {measured:.1f} G/s "
            f"{by} reached in this run; no percentages of it are printed",
            file=sys.stderr,
        )
        return None
    return peak


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


def hf_model(model_path: Path):
    """The GGUF file through transformers, dequantized to fp32 at load."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )


def save_safetensors(model, directory: Path) -> None:
    """transformers refuses to save a model loaded from GGUF; a plain copy of it saves."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(directory)


def export_safetensors(model_path: Path, directory: Path) -> None:
    """The GGUF model, dequantized, as a safetensors directory with its tokenizer: what vLLM
    loads."""
    from transformers import AutoTokenizer

    save_safetensors(hf_model(model_path), directory)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    tokenizer.save_pretrained(directory)
