"""Prefix cache speed-up on a shared-system-prompt workload, and the cost of isolation.

    python bench/prefix_cache.py --requests 64

Runs the same seeded requests (one long system prompt shared by every request of a
tenant, a short distinct question each) through the engine with the prefix cache on and
off, then a mixed workload with the sentinel on/off and scrubbing on/off, in alternating
rounds; prints throughputs (medians) and ratios measured in this run, and the share of
the run's wall time spent inside the sentinel's check and the scrub themselves (which a
noisy machine blurs far less than a difference of two throughputs).
"""

import argparse
import random
import statistics
import time

from common import machine_line, mixed_workload
from kvfence import LLM, SamplingParams

# isort: split
import torch  # after kvfence (see common.py)


def timed(llm: LLM, requests, tenants) -> tuple[float, int]:
    engine = llm.engine
    for (prompt, out_len), tenant in zip(requests, tenants):
        engine.add_request(
            prompt,
            SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True),
            tenant=tenant,
        )
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.delta_token_ids) for o in engine.step())
    return time.perf_counter() - start, tokens


def clock(obj, name: str) -> list[float]:
    """Wraps the method obj.name so that its calls add their seconds to the returned [total]."""
    spent, inner = [0.0], getattr(obj, name)

    def timed_call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    setattr(obj, name, timed_call)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-isolation", action="store_true")
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="isolation runs per configuration (medians)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        help="as kvfence serve --dtype: bfloat16's faster steps make the isolation's share larger",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    system = [rng.randrange(100, 49152) for _ in range(args.system_tokens)]
    shared = [
        (system + [rng.randrange(100, 49152) for _ in range(16)], 16) for _ in range(args.requests)
    ]
    print(f"machine: {machine_line()}; --dtype {args.dtype}")
    results = {}
    for cache in (False, True):
        llm = LLM(
            num_threads=args.threads,
            max_model_len=1024,
            prefix_cache=cache,
            dtype=args.dtype,
        )
        timed(llm, shared[:2], ["warm-up"] * 2)
        seconds, _ = timed(llm, shared, ["acme"] * len(shared))
        stats = llm.engine.prefix_cache_stats()
        results[cache] = seconds
        hit = stats["hits"] / max(1, stats["queried"])
        print(
            f"prefix cache {'on ' if cache else 'off'}: "
            f"{args.requests} requests sharing a {args.system_tokens}-token "
            f"system prompt in {seconds:6.2f} s; prompt tokens served from cache: {hit:.0%}"
        )
    print(f"speed-up from the prefix cache: {results[False] / results[True]:.2f}x")
    if args.skip_isolation:
        return
    work = mixed_workload(args.requests, 1, prompt=(32, 256), output=(32, 128))
    configs = {
        "sentinel enforce, scrub off": {},
        "sentinel off": {"kv_sentinel": "off"},
        "scrub on-free": {"kv_scrub": "on-free"},
    }
    engines = {
        label: LLM(
            num_threads=args.threads,
            max_model_len=1024,
            kv_memory_gib=1.0,
            prefix_cache=False,
            dtype=args.dtype,
            **kw,
        )
        for label, kw in configs.items()
    }
    for llm in engines.values():
        timed(llm, work[:2], ["warm-up"] * 2)
    rates = {label: [] for label in configs}
    wall = {label: 0.0 for label in configs}
    in_sentinel = clock(engines["sentinel enforce, scrub off"].engine.runner, "check")
    in_scrub = clock(engines["scrub on-free"].engine.pool, "scrub")
    # Rounds that take each configuration in turn, so drift on a shared machine hits all alike.
    for _ in range(args.rounds):
        for label, llm in engines.items():
            seconds, tokens = timed(llm, work, ["t"] * len(work))
            rates[label].append(tokens / seconds)
            wall[label] += seconds
    base = statistics.median(rates["sentinel enforce, scrub off"])
    for label, runs in rates.items():
        tok_s = statistics.median(runs)
        print(
            f"{label:28} {tok_s:7.1f} output tok/s  ({tok_s / base:.3f} of the default; "
            f"runs {', '.join(f'{r:.0f}' for r in runs)})"
        )
    print(
        f"time inside the sentinel's checks: "
        f"{in_sentinel[0] / wall['sentinel enforce, scrub off']:.2%} of its runs; "
        f"inside the scrub: {in_scrub[0] / wall['scrub on-free']:.2%} of its runs"
    )


if __name__ == "__main__":
    main()
