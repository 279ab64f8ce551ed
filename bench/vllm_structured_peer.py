"""vLLM's CPU build on bench/structured.py's schema workload, for its --vllm-python.

Runs inside vLLM's own virtualenv, set up as bench/vllm_peer.py says:

    VENV/bin/python bench/vllm_structured_peer.py --model HF_DIR --workload W.json

W.json holds {"schema": ..., "json": [[prompt token ids, max_tokens], ...], "plain": [...]}.
The engine starts once (xgrammar, no free whitespace in JSON: as kvfence's answers) and warms
up on one request of each mode, the schema compiled then; each line read on stdin then names
a mode, whose requests are submitted at once (greedy; plain ignores EOS), and the reply is
that run's result (bench/peer_protocol.py's line protocol).
"""

import json
import os
import sys

from peer_protocol import arguments, reply, timed


def generate(llm, mode: str, workload: dict) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm.reset_prefix_cache()  # as kvfence's runs: every mode starts cold
    items = workload[mode]
    if mode == "json":
        params = [
            SamplingParams(
                temperature=0,
                max_tokens=n,
                structured_outputs=StructuredOutputsParams(json=workload["schema"]),
            )
            for _, n in items
        ]
    else:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in items]
    prompts = [{"prompt_token_ids": ids} for ids, _ in items]
    outputs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    completions = [o.outputs[0] for o in outputs]
    tokens = sum(len(c.token_ids) for c in completions)
    return {
        "requests": len(items),
        "output_tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "truncated": sum(1 for c in completions if c.finish_reason == "length"),
        "lengths": [len(c.token_ids) for c in completions],
    }


def main() -> None:
    ap = arguments(__doc__, "a Hugging Face safetensors directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-gib", default="3", help="VLLM_CPU_KVCACHE_SPACE")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)
    import vllm

    workload = json.load(open(args.workload))
    llm, startup = timed(
        lambda: vllm.LLM(
            model=args.model,
            dtype=args.dtype,
            max_model_len=2048,
            seed=0,
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )
    )
    first = {mode: workload[mode][:1] for mode in ("json", "plain")}
    warm_json = generate(llm, "json", {**workload, **first})
    generate(llm, "plain", {**workload, **first})
    reply(
        {
            "name": f"vllm {vllm.__version__} cpu {args.dtype}, xgrammar",
            "startup_s": startup,
            "first_json_request_s": warm_json["seconds"],  # the schema's compile included
        }
    )
    for line in sys.stdin:
        reply(generate(llm, line.strip(), workload))


if __name__ == "__main__":
    main()
