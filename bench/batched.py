"""kvfence against llama.cpp's C++ `llama-batched-bench` in that tool's own scenario, same
run: B requests of 128 prompt tokens and 128 new tokens submitted at once, B = 1, 16, 64.

    python bench/batched.py --llama-batched-bench LLAMA_CPP/build/bin/llama-batched-bench
    python bench/batched.py --llama-batched-bench ... --dtypes auto,bfloat16 --rounds 3

Build the binary from a llama.cpp tree (the one vendored in the llama-cpp-python sdist
will do): `cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF` and
`cmake --build build --target llama-batched-bench -j 2`. Where that build dies with SIGILL
(its -march=native ggml did on one of our VMs), put the ggml and llama libraries of an
installed llama-cpp-python wheel first: LD_LIBRARY_PATH=VENV/lib/python3.*/site-packages/
llama_cpp/lib (same llama.cpp version). It runs the same GGUF file on the same number of
threads, on random token ids (throughput does not depend on which ids).

Two figures per batch size for each tool: output tokens per second over the whole run,
prefill included (B * 128 over the total time), and generation alone (llama.cpp's S_TG;
for kvfence, the tokens of the steps once every prompt is in, over those steps' time).
Rounds alternate the tools; the medians and the medians of the per-round ratios are printed.
"""

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from common import machine_line, mixed_workload, run_kvfence
from kvfence import LLM

# isort: split
import torch  # after kvfence (see common.py)


def kvfence_figures(llm: LLM, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    workload = [
        (ids, new_tokens) for ids, _ in mixed_workload(batch, seed, prompt=(prompt_len, prompt_len))
    ]
    run = run_kvfence(llm, workload)
    return {"output_tok_s": run["tok_s"], "generation_tok_s": run["generation_tok_s"]}


def run_llamacpp(
    binary: str,
    model: Path,
    threads: int,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
) -> dict:
    """{B: figures} from one llama-batched-bench run over every batch size."""
    done = subprocess.run(
        [
            binary,
            "-m",
            str(model),
            "-t",
            str(threads),
            "-c",
            str(max(batches) * (prompt_len + new_tokens)),
            "-npp",
            str(prompt_len),
            "-ntg",
            str(new_tokens),
            "-npl",
            ",".join(map(str, batches)),
            "--output-format",
            "jsonl",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [
        json.loads(line)
        for line in (done.stdout + done.stderr).splitlines()
        if line.startswith("{")
    ]
    return {
        row["pl"]: {
            "output_tok_s": row["pl"] * row["tg"] / row["t"],
            "generation_tok_s": row["speed_tg"],
        }
        for row in rows
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--llama-batched-bench",
        required=True,
        help="path of llama.cpp's llama-batched-bench binary",
    )
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--dtypes",
        default="auto",
        help="one kvfence engine each: auto, float32, gguf, bfloat16",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {}
    for dtype in args.dtypes.split(","):
        llm = LLM(num_threads=args.threads, max_model_len=1024, kv_memory_gib=3.0, dtype=dtype)
        kvfence_figures(llm, 2, 16, 2, seed=1)  # warm-up
        engines[f"kvfence-{llm.engine.config.dtype}"] = llm
    model = next(iter(engines.values())).engine.model_path
    rounds = []
    for r in range(args.rounds):
        row = {
            name: {
                b: kvfence_figures(llm, b, args.prompt_len, args.new_tokens, seed=r)
                for b in batches
            }
            for name, llm in engines.items()
        }
        row["llama.cpp"] = run_llamacpp(
            args.llama_batched_bench,
            model,
            args.threads,
            batches,
            args.prompt_len,
            args.new_tokens,
        )
        rounds.append(row)

    print(
        f"machine: {machine_line()}; "
        f"{args.prompt_len} prompt + {args.new_tokens} new tokens per request; "
        f"{len(rounds)} rounds, medians"
    )
    for b in batches:
        for figure in ("output_tok_s", "generation_tok_s"):
            values = {tool: [r[tool][b][figure] for r in rounds] for tool in rounds[0]}
            line = ", ".join(f"{tool} {statistics.median(v):.1f}" for tool, v in values.items())
            llamacpp = values["llama.cpp"]
            ratios = ", ".join(
                f"{name} / llama.cpp "
                f"{statistics.median(x / y for x, y in zip(values[name], llamacpp)):.2f}x"
                for name in engines
            )
            print(f"B={b:3d} {figure:16s} {line}; {ratios}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
