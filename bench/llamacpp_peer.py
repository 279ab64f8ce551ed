"""llama.cpp through llama-cpp-python on the same GGUF file and token ids, for
bench/throughput.py --llamacpp-python.

Runs inside its own virtualenv (pip compiles llama.cpp: 6-20 minutes on 2 cores):

    python3 -m venv VENV && VENV/bin/pip install llama-cpp-python==0.3.36
    VENV/bin/python bench/llamacpp_peer.py --model MODEL.gguf --workload W.json

llama-cpp-python runs one request at a time (its server serializes requests behind a lock),
so the requests of a workload run one after another: prefill, then tokens (greedy unless
--temperature) until the request's output length (EOS ignored), on the same threads for
both. See bench/peer_protocol.py for the protocol.
"""

from peer_protocol import arguments, serve


def generate(llm, workload, temperature: float, top_p: float) -> int:
    tokens = 0
    for ids, n in workload:
        # top_k 0 and min_p 0: no cut but top_p, as the other engines; never stops by itself
        for i, _ in enumerate(
            llm.generate(ids, temp=temperature, top_p=top_p, top_k=0, min_p=0.0, reset=True),
            1,
        ):
            if i == n:
                break
        tokens += n
    return tokens


def main() -> None:
    ap = arguments(__doc__, "the GGUF file")
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()
    import llama_cpp

    serve(
        lambda: llama_cpp.Llama(
            model_path=args.model,
            n_ctx=args.max_model_len,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            verbose=False,
        ),
        generate,
        args,
        f"llama-cpp-python {llama_cpp.__version__}",
    )


if __name__ == "__main__":
    main()
