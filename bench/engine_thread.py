"""Does the engine thread inside the server cost throughput, and does HTTP traffic stall it?

    python bench/engine_thread.py --num-requests 48

The same seeded workload (`kvfence bench serve`'s text prompts, greedy, EOS ignored) runs
three ways, one after the other so they never share the cores:
  offline  - LLMEngine stepped directly in this process: no HTTP at all. No design that
             puts the engine in a separate process can beat it, so it bounds that design.
  served   - `kvfence serve` (engine on a thread beside the event loop), all requests
             streamed at once.
  flooded  - the same, while other clients send /tokenize and /v1/models at a set rate
             (from this process, so on a 2-core machine their CPU time is taken too).
Prints output tok/s, inter-token latency, and each served figure as a fraction of offline.
"""

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from serve import free_port, wait

from common import machine_line
from kvfence import LLM, SamplingParams, benchmark

ENGINE = {"max_model_len": 2048, "num_threads": 2, "max_num_seqs": 64}


def offline(texts) -> dict:
    engine = LLM(**ENGINE).engine
    for text, max_tokens in texts:  # tokenized as the server does
        engine.add_request(
            engine.tokenize(text),
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.delta_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tok_s": tokens / elapsed,
    }


async def flood(url: str, stop: asyncio.Event, rate: float, counter: list[int]) -> None:
    """Other clients' traffic: /tokenize of a 200-word text and /v1/models, `rate` requests/s
    in all."""

    async def one(client):
        await client.post(url + "/tokenize", json={"prompt": "the river and the forest " * 40})
        await client.get(url + "/v1/models")
        counter[0] += 2

    async with httpx.AsyncClient(timeout=30) as client:
        pending = set()
        while not stop.is_set():
            pending.add(asyncio.create_task(one(client)))
            pending = {t for t in pending if not t.done()}
            await asyncio.sleep(2 / rate)
        await asyncio.gather(*pending)


async def served(url: str, args, flood_rate: float) -> dict:
    stop, counter = asyncio.Event(), [0]
    task = asyncio.create_task(flood(url, stop, flood_rate, counter)) if flood_rate else None
    report = await benchmark.run(
        url, None, args.num_requests, None, None, args.seed, None, True, progress=False
    )
    stop.set()
    if task:
        await task
    report["flood_requests_per_s"] = counter[0] / report["seconds"]
    return report


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument(
        "--flood-rates",
        default="100,400",
        help="other HTTP requests/s sent during the flooded runs",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    texts = benchmark.workload(args.num_requests, args.seed)
    report = {"machine": machine_line()}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvfence.cli",
            "serve",
            "--port",
            str(port),
            "--max-model-len",
            str(ENGINE["max_model_len"]),
            "--threads",
            str(ENGINE["num_threads"]),
            "--max-num-seqs",
            str(ENGINE["max_num_seqs"]),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait(url, [proc])
        report["served"] = asyncio.run(served(url, args, 0))
        for rate in args.flood_rates.split(","):
            report[f"flooded {rate}/s"] = asyncio.run(served(url, args, float(rate)))
    finally:
        proc.terminate()
        proc.wait(30)
    report["offline"] = offline(texts)

    base = report["offline"]["output_tok_s"]
    print(f"machine: {report['machine']}; {args.num_requests} requests at once")
    print(f"{'offline':15} {base:7.1f} output tok/s")
    for name in [k for k in report if k.startswith(("served", "flooded"))]:
        r = report[name]
        extra = (
            f", beside {r['flood_requests_per_s']:.0f} other HTTP requests/s answered"
            if r["flood_requests_per_s"]
            else ""
        )
        print(
            f"{name:15} {r['output_tok_s']:7.1f} output tok/s = "
            f"{r['output_tok_s'] / base:.2f} of offline; "
            f"ITL median {1000 * r['itl_s']['median']:.1f} ms, "
            f"p99 {1000 * r['itl_s']['p99']:.1f} ms; "
            f"{r['failed']} failed{extra}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
