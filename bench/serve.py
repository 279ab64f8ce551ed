"""Serving benchmark, side by side in one run: kvfence unified (the default, which runs the
GGUF blocks; `--dtype gguf-int8`; `--dtype float32`; `--dtype bfloat16`), kvfence 1P1D
(router + one prefill + one decode worker), and llama.cpp's server on the same GGUF file.
Each server also answers a few 512-token prompts alone first: time to first token under no
load.

    python bench/serve.py --num-requests 32 --concurrency 16
    # with llama-cpp-python[server]:
    python bench/serve.py --llamacpp-python /path/to/venv/bin/python

Each server is started here, measured with `kvfence bench serve` logic (the same seeded
workload), and stopped before the next one starts, so they never share the cores.
"""

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common import machine_line
from kvfence import benchmark
from kvfence.model.loader import default_model_path


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


def internal_token_file() -> str:
    """A fresh secret for the router and workers of one run."""
    import secrets
    import tempfile

    with tempfile.NamedTemporaryFile("w", prefix="kvfence-token-", delete=False) as f:
        f.write(secrets.token_urlsafe(32))
    return f.name


def start(kind: str, args) -> tuple[list[subprocess.Popen], str]:
    kv = [sys.executable, "-m", "kvfence.cli"]
    common = ["--max-model-len", "2048", "--threads", str(args.threads)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dtypes = {
        "kvfence": [],
        "kvfence-int8": ["--dtype", "gguf-int8"],
        "kvfence-fp32": ["--dtype", "float32"],
        "kvfence-bf16": ["--dtype", "bfloat16"],
    }
    if kind in dtypes:
        dtype = dtypes[kind]
        procs = [subprocess.Popen([*kv, "serve", "--port", str(port), *common, *dtype], **quiet)]
    elif kind == "kvfence-1p1d":
        workers = [free_port(), free_port()]
        auth = ["--internal-token-file", internal_token_file()]
        procs = [
            subprocess.Popen(
                [
                    *kv,
                    "serve",
                    "--role",
                    role,
                    "--port",
                    str(p),
                    *common[:2],
                    "--threads",
                    "1",
                    *auth,
                ],
                **quiet,
            )
            for role, p in zip(("prefill", "decode"), workers)
        ]
        for p in workers:
            wait(f"http://127.0.0.1:{p}", procs)
        procs.append(
            subprocess.Popen(
                [
                    *kv,
                    "router",
                    "--port",
                    str(port),
                    "--prefill",
                    f"http://127.0.0.1:{workers[0]}",
                    "--decode",
                    f"http://127.0.0.1:{workers[1]}",
                    *auth,
                ],
                **quiet,
            )
        )
    else:
        procs = [
            subprocess.Popen(
                [
                    args.llamacpp_python,
                    "-m",
                    "llama_cpp.server",
                    "--model",
                    str(default_model_path()),
                    "--n_threads",
                    str(args.threads),
                    "--n_threads_batch",
                    str(args.threads),
                    "--n_ctx",
                    "4096",
                    "--port",
                    str(port),
                    # by default a new request cuts the stream in progress; queue them instead
                    "--interrupt_requests",
                    "False",
                ],
                **quiet,
            )
        ]
        wait(url, procs, path="/v1/models")
        return procs, url
    wait(url, procs)
    return procs, url


def prompts_of_512_tokens(count: int, seed: int) -> list[str]:
    """Distinct prompts (no prefix-cache hits) of exactly 512 tokens: words that are one
    token each."""
    from kvfence.model.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    words = [
        w
        for w in sorted(set(benchmark.WORDS))
        if len(tok.encode(" " + w, add_special_tokens=False)) == 1
    ]
    rng = random.Random(seed)
    prompts = ["".join(" " + rng.choice(words) for _ in range(512)) for _ in range(count)]
    assert all(len(tok.encode(p, add_special_tokens=False)) == 512 for p in prompts)
    return prompts


async def unloaded_ttft(url: str, prompts: list[str]) -> float:
    """Median time to first token of `prompts` sent one at a time."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        results = [await benchmark.one(client, url, model, p, 1, {}, False) for p in prompts]
    if not all(r.ok for r in results):
        raise RuntimeError(f"TTFT request failed: {[r.error for r in results if not r.ok]}")
    return statistics.median(r.ttft for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--llamacpp-python",
        default=None,
        help="a Python with llama-cpp-python[server] installed",
    )
    ap.add_argument(
        "--only",
        default=None,
        help="comma list of kvfence,kvfence-int8,kvfence-fp32,kvfence-bf16,kvfence-1p1d,llama.cpp",
    )
    ap.add_argument(
        "--ttft-prompts",
        type=int,
        default=5,
        help="512-token prompts timed alone per server (0: skip)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    kinds = ["kvfence", "kvfence-int8", "kvfence-fp32", "kvfence-bf16", "kvfence-1p1d"]
    kinds += ["llama.cpp"] if args.llamacpp_python else []
    ttft_prompts = (
        prompts_of_512_tokens(args.ttft_prompts + 1, args.seed) if args.ttft_prompts else []
    )
    if args.only:
        kinds = [k for k in kinds if k in args.only.split(",")]
    reports, ttft = {}, {}
    for kind in kinds:
        procs, url = start(kind, args)
        try:
            if ttft_prompts:
                asyncio.run(unloaded_ttft(url, ttft_prompts[-1:]))  # warm-up
                ttft[kind] = asyncio.run(unloaded_ttft(url, ttft_prompts[:-1]))
            # llama.cpp's server knows no ignore_eos: its outputs may end early, counted as they are
            reports[kind] = asyncio.run(
                benchmark.run(
                    url,
                    None,
                    args.num_requests,
                    args.concurrency,
                    None,
                    args.seed,
                    None,
                    ignore_eos=kind != "llama.cpp",
                    progress=False,
                )
            )
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
        print(benchmark.format_table(reports[kind]).replace(url, kind), flush=True)
    print(
        f"\nmachine: {machine_line()}; {args.num_requests} requests, concurrency {args.concurrency}"
    )
    base = reports.get("kvfence")

    def ms(v):
        return "-" if v is None else f"{1000 * v:.1f}"

    for kind, r in reports.items():
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x of unified" if base else ""
        print(
            f"{kind:14} {r['output_tok_s']:8.1f} output tok/s  "
            f"TTFT median {ms(r['ttft_s']['median']):>8} ms  "
            f"ITL median {ms(r['itl_s']['median']):>6} ms  {r['failed']} failed  {ratio}"
        )
    for kind, t in ttft.items():
        print(
            f"{kind:14} TTFT of a 512-token prompt alone "
            f"(median of {args.ttft_prompts}): {1000 * t:.0f} ms"
        )
    if args.json:
        args.json.write_text(json.dumps({"load": reports, "ttft_512_s": ttft}, indent=2))


if __name__ == "__main__":
    main()
