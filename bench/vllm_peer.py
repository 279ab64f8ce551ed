"""vLLM's CPU build on the same workload, for bench/throughput.py --vllm-python.

Runs inside vLLM's own virtualenv (it pins other versions of transformers and friends):

    VENV/bin/python bench/vllm_peer.py --model HF_DIR --workload W.json --out R.json

W.json: {"mixed": [[prompt token ids, output length], ...], "batch64": [...]}. Each list is
submitted at once, greedy, EOS ignored; the result is output tokens per second for each.
Both cores bound (VLLM_CPU_OMP_THREADS_BIND); --dtype float32 (the strongest setting on
AVX2-only CPUs) or bfloat16 (vLLM's CPU default, fast where the CPU has AMX).
"""
import argparse
import json
import os
import time


def run(llm, workload) -> dict:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"requests": len(workload), "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face safetensors directory")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm

    t = time.perf_counter()
    llm = vllm.LLM(model=args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.max_num_seqs, seed=0)
    startup = time.perf_counter() - t
    workload = json.load(open(args.workload))
    run(llm, workload["mixed"][:2])  # warm-up
    report = {"version": vllm.__version__, "dtype": args.dtype, "startup_s": startup,
              **{name: run(llm, items) for name, items in workload.items()}}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
