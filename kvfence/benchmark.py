"""`kvfence bench serve`: a seeded load against any OpenAI-compatible server.

Sends a fixed workload (text prompts of a seeded length, max_tokens of a seeded length)
at a given concurrency or Poisson request rate, streams every answer, and reports request
throughput, output tokens/s, time to first token and inter-token latency.
"""

import asyncio
import json
import random
import statistics
import time
from dataclasses import MISSING, dataclass, field

import httpx
from tqdm import tqdm

from kvfence import sse
from kvfence.options import option

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no what up out "
    "who them some time could into than other then its about over only new these may people also "
    "after first two like river market engine garden window letter planet signal forest winter "
    "harbor silver machine"
).split()


@dataclass
class BenchOptions:
    base_url: str = option(MISSING, "server root, e.g. http://127.0.0.1:8000", metavar="URL")
    model: str | None = option(
        None, "model id (default: the first listed by /v1/models)", metavar="ID"
    )
    num_requests: int = option(64, "requests of each pass")
    concurrency: str = option(
        "16", "in-flight requests; a comma list runs one pass per level", metavar="N[,N...]"
    )
    request_rate: float | None = option(None, "Poisson arrivals per second instead")
    seed: int = option(0, "seed of the workload")
    api_key: str | None = option(None, "sent as Authorization: Bearer KEY", metavar="KEY")
    ignore_eos: bool = option(True, "do not send ignore_eos, for servers that reject it")
    json: bool = option(False, "print JSON instead of a table")
    plot: str | None = option(
        None, "write a PNG of latency against load (needs matplotlib)", metavar="FILE"
    )


@dataclass
class Result:
    ok: bool
    prompt_words: int
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


def workload(num_requests: int, seed: int, prompt_range=(32, 512), output_range=(32, 256)):
    rng = random.Random(seed)
    return [
        (
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_range))),
            rng.randint(*output_range),
        )
        for _ in range(num_requests)
    ]


async def one(client, url, model, prompt, max_tokens, headers, ignore_eos) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    res = Result(False, len(prompt.split()))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for event in sse.events(r):
                if event.get("usage"):
                    res.output_tokens = event["usage"].get("completion_tokens", 0)
                if any(c.get("text") for c in event.get("choices", [])):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.gaps.append(now - last)
                    last = now
                    chunks += 1
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.output_tokens = res.output_tokens or chunks
    res.latency = time.perf_counter() - start
    res.ok = True
    return res


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


async def run(
    base_url: str,
    model: str | None,
    num_requests: int,
    concurrency: int | None,
    request_rate: float | None,
    seed: int,
    api_key: str | None,
    ignore_eos: bool,
    progress: bool = True,
) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base_url = base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client:
        if model is None:
            models = (await client.get(base_url + "/v1/models", headers=headers)).json()["data"]
            model = models[0]["id"]
        jobs = workload(num_requests, seed)
        bar = tqdm(total=len(jobs), desc="requests", disable=not progress)
        limit = asyncio.Semaphore(concurrency or len(jobs))
        rng = random.Random(seed + 1)

        async def limited(prompt, max_tokens):
            async with limit:
                res = await one(client, base_url, model, prompt, max_tokens, headers, ignore_eos)
                bar.update(1)
                return res

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in jobs:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        bar.close()
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    return {
        "base_url": base_url,
        "model": model,
        "requests": num_requests,
        "completed": len(done),
        "failed": len(results) - len(done),
        "concurrency": concurrency,
        "request_rate": request_rate,
        "seconds": elapsed,
        "request_throughput": len(done) / elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "ttft_s": _stats([r.ttft for r in done if r.ttft is not None]),
        "itl_s": _stats([g for r in done for g in r.gaps]),
        "latency_s": _stats([r.latency for r in done]),
        "first_error": next((r.error for r in results if r.error), None),
    }


def format_table(report: dict) -> str:
    def ms(d, key):
        return "-" if d[key] is None else f"{1000 * d[key]:.1f}"

    lines = [
        f"{report['base_url']}  model {report['model']}  "
        f"{report['completed']}/{report['requests']} completed "
        f"in {report['seconds']:.1f} s",
        f"request throughput  {report['request_throughput']:.2f} req/s",
        f"output throughput   {report['output_tok_s']:.1f} tok/s "
        f"({report['output_tokens']} tokens)",
        f"{'':18}{'mean':>10}{'median':>10}{'p99':>10}  (ms)",
    ]
    for name, key in (
        ("time to first token", "ttft_s"),
        ("inter-token", "itl_s"),
        ("request latency", "latency_s"),
    ):
        d = report[key]
        lines.append(f"{name:18}{ms(d, 'mean'):>10}{ms(d, 'median'):>10}{ms(d, 'p99'):>10}")
    if report["failed"]:
        lines.append(f"failed: {report['failed']} (first: {report['first_error']})")
    return "\n".join(lines)


def plot(reports: list[dict], path: str) -> None:
    """Latency against load: one point per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("the PNG plot needs matplotlib: pip install matplotlib") from e
    loads = [r["output_tok_s"] for r in reports]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        loads,
        [1000 * r["ttft_s"]["median"] for r in reports],
        "o-",
        label="TTFT median",
    )
    ax.plot(loads, [1000 * r["itl_s"]["median"] for r in reports], "s-", label="ITL median")
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def run_bench(options: BenchOptions) -> int:
    levels = [int(c) for c in options.concurrency.split(",")] if options.concurrency else [None]
    reports = []
    for level in levels:
        report = asyncio.run(
            run(
                options.base_url,
                options.model,
                options.num_requests,
                level,
                options.request_rate,
                options.seed,
                options.api_key,
                options.ignore_eos,
                progress=not options.json,
            )
        )
        reports.append(report)
        if not options.json:
            print(format_table(report))
    if options.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
    if options.plot:
        plot(reports, options.plot)
    return 0 if all(r["failed"] == 0 for r in reports) else 1
