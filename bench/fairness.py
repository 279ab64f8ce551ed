"""Fairness under a flood, on a real server: tenant A floods (64 requests of 512 + 256
tokens at once), tenant B sends 16 short chats at a steady rate. Reports B's time to first
token (median, p99) alone, under the flood with `--scheduling fair` and with `fifo`, the
flood's own output throughput (its tokens over the time from its start to its last request's
end) and its median gap between tokens (one step at the flood's batch); then the same with
`--request-log` on, for its cost.

    python bench/fairness.py [--flood 64 --chats 16 --interval 2]

Each server is started here and stopped before the next, so they never share the cores.
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve import free_port, prompts_of_512_tokens, wait

from common import machine_line
from kvfence import benchmark, sse

KEYS = {"sk-flood-0000000000": "flood", "sk-steady-000000000": "steady"}
CHAT = [{"role": "user", "content": "Name one colour."}]


async def chat(client, url, model, key) -> float:
    """Time to the first content chunk of one short streamed chat."""
    body = {
        "model": model,
        "messages": CHAT,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    async with client.stream(
        "POST",
        url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat failed: {r.status_code} {(await r.aread())[:200]!r}")
        ttft = None
        async for event in sse.events(r):
            choices = event.get("choices", [])
            if ttft is None and any(c.get("delta", {}).get("content") for c in choices):
                ttft = time.perf_counter() - start
    return ttft if ttft is not None else time.perf_counter() - start


async def scenario(url: str, flood_prompts: list[str] | None, chats: int, interval: float) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client:
        model = await client.get(
            url + "/v1/models", headers={"Authorization": f"Bearer {list(KEYS)[0]}"}
        )
        model = model.json()["data"][0]["id"]
        flood_key, steady_key = list(KEYS)
        start = time.perf_counter()
        flood = [
            asyncio.create_task(
                benchmark.one(
                    client,
                    url,
                    model,
                    p,
                    256,
                    {"Authorization": f"Bearer {flood_key}"},
                    True,
                )
            )
            for p in flood_prompts or []
        ]
        await asyncio.sleep(1.0 if flood else 0)  # the flood is queued before the chats start
        ttfts = []
        for _ in range(chats):
            ttfts.append(await chat(client, url, model, steady_key))
            await asyncio.sleep(interval)
        results = await asyncio.gather(*flood)
        elapsed = time.perf_counter() - start
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"flood requests failed: {failed[:3]}")
    ordered = sorted(ttfts)
    gaps = [g for r in results for g in r.gaps]
    return {
        "ttft_median_s": statistics.median(ordered),
        "ttft_p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        # every flood request starts at `start`: the last one's latency is the flood's span
        "flood_output_tok_s": (
            sum(r.output_tokens for r in results) / max(r.latency for r in results)
            if results
            else 0.0
        ),
        "flood_step_s": statistics.median(gaps) if gaps else 0.0,
        "elapsed_s": elapsed,
    }


def start_kvfence(args, extra: list[str], keys_file: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvfence.cli",
        "serve",
        "--port",
        str(port),
        "--threads",
        str(args.threads),
        "--max-model-len",
        "2048",
        "--api-keys",
        keys_file,
        "--max-pending",
        "512",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait(f"http://127.0.0.1:{port}", [proc])
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--flood", type=int, default=64)
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument(
        "--interval",
        type=float,
        default=2.0,
        help="seconds between the steady tenant's chats",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--skip-log-run", action="store_true", help="leave out the run with --request-log"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvfence-fairness-"))
    keys_file = tmp / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    flood = prompts_of_512_tokens(args.flood, seed=1)
    runs = {
        "alone": (["--scheduling", "fair"], None),
        "fair": (["--scheduling", "fair"], flood),
        "fifo": (["--scheduling", "fifo"], flood),
        "fair + request log": (
            ["--scheduling", "fair", "--request-log", str(tmp / "requests.jsonl")],
            flood,
        ),
    }
    if args.skip_log_run:
        del runs["fair + request log"]
    report = {}
    for name, (extra, prompts) in runs.items():
        proc, url = start_kvfence(args, extra, str(keys_file))
        try:
            asyncio.run(scenario(url, None, 2, 0))  # warm-up
            report[name] = asyncio.run(scenario(url, prompts, args.chats, args.interval))
        finally:
            proc.terminate()
            proc.wait(30)
        r = report[name]
        print(
            f"{name:20} steady tenant TTFT median {1000 * r['ttft_median_s']:7.0f} ms  p99 "
            f"{1000 * r['ttft_p99_s']:7.0f} ms  flood output {r['flood_output_tok_s']:6.1f} tok/s, "
            f"step {1000 * r['flood_step_s']:5.0f} ms",
            flush=True,
        )
    alone, fair, fifo = report["alone"], report["fair"], report["fifo"]
    print(f"\nmachine: {machine_line()}")
    target = 2 * (alone["ttft_p99_s"] + fair["flood_step_s"])
    print(
        f"p99 TTFT under the flood / alone: fair {fair['ttft_p99_s'] / alone['ttft_p99_s']:.2f}x, "
        f"fifo {fifo['ttft_p99_s'] / alone['ttft_p99_s']:.2f}x; fair p99 "
        f"{1000 * fair['ttft_p99_s']:.0f} ms against the target of 2 x (alone p99 + one step "
        f"at the flood's batch) = {1000 * target:.0f} ms: {fair['ttft_p99_s'] / target:.2f} of it"
    )
    print(
        f"flood throughput fair / fifo: "
        f"{fair['flood_output_tok_s'] / fifo['flood_output_tok_s']:.3f} "
        f"(target: within 10%)"
    )
    if "fair + request log" in report:
        logged = report["fair + request log"]["flood_output_tok_s"]
        print(
            f"with the request log / without: {logged / fair['flood_output_tok_s']:.3f} "
            f"(target: cost under 1%)"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
