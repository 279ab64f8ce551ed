"""The line protocol between bench/throughput.py and a peer engine that runs in its own
virtualenv (bench/vllm_peer.py, bench/llamacpp_peer.py), so that their runs can alternate
with kvfence's on a noisy machine.

The peer starts its engine once and prints a ready line; then each line read on stdin names
a workload of the JSON file it was given ({"mixed": [[prompt token ids, output length], ...],
...}), and the peer prints that run's result. Every reply is one stdout line: RESULT_PREFIX
and a JSON object (engines log on stdout too).
"""

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

RESULT_PREFIX = "PEER-RESULT "


def reply(obj: dict) -> None:
    print(RESULT_PREFIX + json.dumps(obj), flush=True)


def arguments(doc: str, model_help: str) -> argparse.ArgumentParser:
    """The arguments every peer takes; a peer adds its own."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help=model_help)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    return ap


def timed(run) -> tuple[object, float]:
    t = time.perf_counter()
    result = run()
    return result, time.perf_counter() - t


def serve(start, generate, args: argparse.Namespace, name: str) -> None:
    """Starts the engine (start() returns it) and warms it up on one request; replies ready
    with its start-up time and the names of its workloads (args.workload's file); then runs
    each workload named on stdin through generate(engine, workload, args.temperature,
    args.top_p), which returns the number of output tokens."""
    workloads = json.load(open(args.workload))
    engine, startup = timed(start)
    generate(engine, workloads["mixed"][:1], args.temperature, args.top_p)
    reply({"name": name, "startup_s": startup, "workloads": list(workloads)})
    for line in sys.stdin:
        workload = workloads[line.strip()]
        run = functools.partial(generate, engine, workload, args.temperature, args.top_p)
        tokens, seconds = timed(run)
        reply(
            {
                "requests": len(workload),
                "output_tokens": tokens,
                "seconds": seconds,
                "tok_s": tokens / seconds,
            }
        )


class Peer:
    """A peer engine in its own virtualenv (bench/peer_protocol.py), started once; runs the
    workloads of its file when asked."""

    def __init__(self, python: str, script: str, args: list[str]):
        self.prefix = RESULT_PREFIX
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).parent / script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self.result()  # waits for start-up

    def result(self) -> dict:
        for line in self.proc.stdout:  # engines log on stdout too
            if line.startswith(self.prefix):
                return json.loads(line[len(self.prefix) :])
        raise RuntimeError(f"{self.proc.args[1]} exited with {self.proc.wait()}")

    def run(self, workload_name: str) -> dict:
        self.proc.stdin.write(workload_name + "\n")
        self.proc.stdin.flush()
        return self.result()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
