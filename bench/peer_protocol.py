"""The line protocol between bench/throughput.py and a peer engine that runs in its own
virtualenv (bench/vllm_peer.py, bench/llamacpp_peer.py), so that their runs can alternate
with kvfence's on a noisy machine.

The peer starts its engine once and prints a ready line; then each line read on stdin names
a workload of the JSON file it was given ({"mixed": [[prompt token ids, output length], ...],
...}), and the peer prints that run's result. Every reply is one stdout line: RESULT_PREFIX
and a JSON object (engines log on stdout too).
"""
import json
import sys
import time

RESULT_PREFIX = "PEER-RESULT "


def reply(obj: dict) -> None:
    print(RESULT_PREFIX + json.dumps(obj), flush=True)


def timed(generate, workload) -> dict:
    """Runs generate(workload), which returns the number of output tokens; its throughput."""
    t = time.perf_counter()
    tokens = generate(workload)
    elapsed = time.perf_counter() - t
    return {"requests": len(workload), "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}


def serve(generate, workload_file: str, info: dict) -> None:
    """Replies `info` (ready), then runs each workload named on stdin through generate."""
    workloads = json.load(open(workload_file))
    reply(info)
    for line in sys.stdin:
        reply(timed(generate, workloads[line.strip()]))
