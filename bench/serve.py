"""Serving benchmark, side by side in one run: kvfence unified, kvfence 1P1D (router +
one prefill + one decode worker), and llama.cpp's server on the same GGUF file.

    python bench/serve.py --num-requests 32 --concurrency 16
    python bench/serve.py --llamacpp-python /path/to/venv/bin/python   # with llama-cpp-python[server]

Each server is started here, measured with `kvfence bench serve` logic (the same seeded
workload), and stopped before the next one starts, so they never share the cores.
"""
import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line  # noqa: E402

from kvfence import benchmark  # noqa: E402
from kvfence.model.loader import default_model_path  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str, procs, path="/health", timeout=300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server exited while starting ({url})")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def start(kind: str, args) -> tuple[list[subprocess.Popen], str]:
    kv = [sys.executable, "-m", "kvfence.cli"]
    common = ["--max-model-len", "2048", "--threads", str(args.threads)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if kind == "kvfence":
        procs = [subprocess.Popen([*kv, "serve", "--port", str(port), *common], **quiet)]
    elif kind == "kvfence-1p1d":
        workers = [free_port(), free_port()]
        procs = [subprocess.Popen([*kv, "serve", "--role", role, "--port", str(p), *common[:2], "--threads", "1"],
                                  **quiet) for role, p in zip(("prefill", "decode"), workers)]
        for p in workers:
            wait(f"http://127.0.0.1:{p}", procs)
        procs.append(subprocess.Popen([*kv, "router", "--port", str(port), "--prefill", f"http://127.0.0.1:{workers[0]}",
                                       "--decode", f"http://127.0.0.1:{workers[1]}"], **quiet))
    else:
        procs = [subprocess.Popen([args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(default_model_path()),
                                   "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "4096", "--port", str(port),
                                   # by default a new request cuts the stream in progress; queue them instead
                                   "--interrupt_requests", "False"], **quiet)]
        wait(url, procs, path="/v1/models")
        return procs, url
    wait(url, procs)
    return procs, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llamacpp-python", default=None, help="a Python with llama-cpp-python[server] installed")
    ap.add_argument("--only", default=None, help="comma list of kvfence,kvfence-1p1d,llama.cpp")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    kinds = ["kvfence", "kvfence-1p1d"] + (["llama.cpp"] if args.llamacpp_python else [])
    if args.only:
        kinds = [k for k in kinds if k in args.only.split(",")]
    reports = {}
    for kind in kinds:
        procs, url = start(kind, args)
        try:
            # llama.cpp's server knows no ignore_eos: its outputs may end early, counted as they are
            reports[kind] = asyncio.run(benchmark.run(url, None, args.num_requests, args.concurrency, None, args.seed,
                                                      None, ignore_eos=kind != "llama.cpp", progress=False))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
        print(benchmark.format_table(reports[kind]).replace(url, kind), flush=True)
    print(f"\nmachine: {machine_line()}; {args.num_requests} requests, concurrency {args.concurrency}")
    base = reports.get("kvfence")
    ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"  # noqa: E731
    for kind, r in reports.items():
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x of unified" if base else ""
        print(f"{kind:14} {r['output_tok_s']:8.1f} output tok/s  TTFT median {ms(r['ttft_s']['median']):>8} ms  "
              f"ITL median {ms(r['itl_s']['median']):>6} ms  {r['failed']} failed  {ratio}")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))


if __name__ == "__main__":
    main()
