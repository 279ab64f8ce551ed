"""The `kvfence` command: generate, serve, router, audit, check-config, bench."""
import argparse
import json
import logging
import sys

from kvfence.config import DTYPES, KV_CACHE_DTYPES, ConfigError, EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or safetensors directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--max-model-len", type=int, default=None, help="advertised context length (default: the model's)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--num-kv-pages", type=int, default=None, help="KV pool size in pages (default: from --kv-memory-gib)")
    g.add_argument("--kv-memory-gib", type=float, default=2.0, help="KV pool memory budget when --num-kv-pages is not given")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step (chunked prefill)")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--enforce-eager", action="store_true",
                   help="GPU: launch every kernel of a decode step from Python instead of replaying CUDA graphs")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    g.add_argument("--kv-sentinel", choices=["off", "log", "enforce"], default="enforce",
                   help="check KV page ownership before every step")
    g.add_argument("--kv-scrub", choices=["off", "on-free"], default="off", help="zero KV pages when they are freed")
    g.add_argument("--attention", choices=["auto", "kernel", "torch"], default="auto",
                   help="decode attention: the C++ kernel reading the pool in place (CPU, built on first use), "
                        "or pages gathered in PyTorch (any device); auto picks the kernel where it builds")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="linear weights: gguf keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks and gives the same results "
                        "as float32 from a sixth to a third of the bytes (CPU with AVX-512 or AVX2); auto takes gguf where "
                        "it runs, else float32; gguf-int8 also rounds activations to 8 bits and multiplies on "
                        "integers, as llama.cpp does: faster, but not bit-equal to float32 (see README); bfloat16 "
                        "halves the KV pool and is 2-3x faster at large batches where "
                        "the CPU has AVX-512 BF16 or AMX, but is not bit-equal to float32 (see README)")
    g.add_argument("--kv-cache-dtype", choices=["auto", *KV_CACHE_DTYPES], default="auto",
                   help="KV pool storage: bfloat16 halves its memory and the bytes decode attention reads (math "
                        "stays fp32), fp8 (e4m3, unscaled) quarters them at a larger rounding error; auto takes "
                        "bfloat16 with --dtype bfloat16 or gguf-int8, else float32. Disaggregated workers must agree")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable the per-tenant prefix cache")
    g.add_argument("--request-log", default=None, metavar="FILE",
                   help="append one hash-chained JSON line per finished request (tenant, times, tokens, "
                        "sentinel verdict, prompt SHA-256; never its text); check it with kvfence verify-log")
    g.add_argument("--request-log-max-mb", type=float, default=64.0,
                   help="rotate the request log past this size (FILE.1, FILE.2, ...; the chain continues)")
    g.add_argument("--scheduling", choices=["fair", "fifo"], default="fair",
                   help="fair: prefill work goes to the tenant with the least weighted service so far "
                        "(weights from --api-keys); fifo: first come first served across tenants")
    g.add_argument("--inject-fault", choices=["legacy-reject-path", "truncated-transfer"], default=None,
                   help="TEST ONLY: re-create the 2026 KV leak, or ship truncated KV transfers")
    g.add_argument("--seed", type=int, help="seed of unseeded sampling (default: from the OS)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, max_model_len=args.max_model_len, page_size=args.page_size,
        num_kv_pages=args.num_kv_pages, kv_memory_gib=args.kv_memory_gib, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, device=args.device, enforce_eager=args.enforce_eager,
        num_threads=args.threads, kv_sentinel=args.kv_sentinel, kv_scrub=args.kv_scrub, attention=args.attention,
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, prefix_cache=not args.no_prefix_cache,
        scheduling=args.scheduling, request_log=args.request_log, request_log_max_mb=args.request_log_max_mb,
        inject_fault=args.inject_fault, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvfence.llm import LLM
    from kvfence.engine.sampling_params import SamplingParams

    llm = LLM(**vars(engine_config(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop or [])
    if args.chat:
        result = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        result = llm.generate(args.prompt, params)[0]
    out = result.outputs[0]
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import ipaddress

    from kvfence.config import check_fault_allowed
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.model.loader import resolve_model_path
    from kvfence.server.api import Server, create_app, serve
    from kvfence.server.auth import ApiKeys

    log = logging.getLogger("kvfence.server")
    keys = ApiKeys.from_file(args.api_keys) if args.api_keys else ApiKeys()
    try:
        public = not ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        public = args.host != "localhost"
    if public and not keys.enabled:
        log.warning("WARNING: serving on %s without API keys: anyone who can reach this address can use the "
                    "model. Pass --api-keys FILE.", args.host)
    if args.role != "unified":
        from kvfence.disagg import read_internal_token, require_internal_token, worker_client

        token = read_internal_token(args.internal_token_file, f"kvfence serve --role {args.role}")
    elif args.internal_token_file:
        raise ValueError("--internal-token-file is for prefill and decode workers (--role) and the router")
    if args.stream_stall_timeout <= 0:
        raise ConfigError(f"--stream-stall-timeout must be over 0, not {args.stream_stall_timeout}")
    config = engine_config(args)
    check_fault_allowed(config.inject_fault)  # before the model loads, as the engine checks again
    resolve_model_path(config.model)  # a bad path fails here, before the server starts

    def build() -> Server:
        server = Server(LLMEngine(config), keys, args.served_model_name, args.max_pending,
                        args.max_body_bytes, stream_stall_timeout=args.stream_stall_timeout,
                        report_cached_tokens=keys.enabled or not public)
        if args.metrics_port is not None:
            server.metrics.serve(args.metrics_host, args.metrics_port)
            log.info("metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)
        if args.role != "unified":
            from kvfence.disagg.transfer import KVTransfer

            app.state.transfer = KVTransfer(server.engine.pool, f"kvfence-{args.role}-{args.port}")
            app.state.http = worker_client(token)
        log.info("%s on http://%s:%d: %s", args.role, args.host, args.port, server.engine.describe())
        return server

    app = create_app(build, role=args.role, serve_metrics=args.metrics_port is None)
    if args.role != "unified":
        require_internal_token(app, token)
    if args.role == "prefill":
        from kvfence.disagg import prefill

        prefill.add_routes(app, args.park_timeout)
    elif args.role == "decode":
        from kvfence.disagg import decode

        decode.add_routes(app, args.kv_transfer_timeout)
    keep_alive = {}
    if args.role != "unified":
        from kvfence.disagg import WORKER_KEEPALIVE_S

        keep_alive["timeout_keep_alive"] = WORKER_KEEPALIVE_S
    serve(app, args.host, args.port, log_level="warning", access_log=False, **keep_alive)
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kvfence.disagg import read_internal_token
    from kvfence.disagg.router import create_router

    token = read_internal_token(args.internal_token_file, "kvfence router")
    uvicorn.run(create_router(args.prefill, args.decode, token), host=args.host, port=args.port,
                log_level="warning", access_log=False)
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    """N prefill and M decode workers plus a router on this machine, until interrupted."""
    import os
    import secrets
    import subprocess
    import tempfile
    import time

    import httpx

    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    # The cluster's internal token, readable by this user only, removed when the cluster stops.
    fd, token_file = tempfile.mkstemp(prefix="kvfence-internal-token-")
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    base = [sys.executable, "-m", "kvfence.cli"]
    procs, urls = [], {"prefill": [], "decode": []}
    port = args.port + 1
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for _ in range(count):
            urls[role].append(f"http://127.0.0.1:{port}")
            procs.append(subprocess.Popen([*base, "serve", "--role", role, "--port", str(port),
                                           "--internal-token-file", token_file,
                                           "--threads", str(args.threads_per_worker), *worker_args]))
            port += 1
    try:
        for url in urls["prefill"] + urls["decode"]:
            while True:
                if any(p.poll() is not None for p in procs):
                    print("kvfence cluster: a worker exited during start-up", file=sys.stderr)
                    return 1
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
        router = [*base, "router", "--host", args.host, "--port", str(args.port),
                  "--internal-token-file", token_file]
        router += [a for u in urls["prefill"] for a in ("--prefill", u)]
        router += [a for u in urls["decode"] for a in ("--decode", u)]
        procs.append(subprocess.Popen(router))
        logging.getLogger("kvfence").info("cluster up: router on %s:%d, prefill %s, decode %s", args.host, args.port,
                                          urls["prefill"], urls["decode"])
        procs[-1].wait()
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(15)
        os.unlink(token_file)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from kvfence import benchmark

    return benchmark.main(args)


def cmd_audit(args: argparse.Namespace) -> int:
    import asyncio

    from kvfence.audit.auditor import AuditError, Auditor, format_report

    if not args.base_url and not args.workers:
        print("kvfence audit: give --base-url URL, --workers URL ..., or both", file=sys.stderr)
        return 2
    auditor = Auditor(args.base_url, args.api_key, args.model, args.max_model_len, args.pool_tokens, args.canaries,
                      args.concurrency, progress=not args.json, seed=args.seed, workers=args.workers)
    try:
        report = asyncio.run(auditor.run())
    except AuditError as e:
        print(f"kvfence audit: could not run: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 1 if report.findings else 0


def cmd_verify_log(args: argparse.Namespace) -> int:
    from kvfence.engine.request_log import verify

    verdict = verify(args.file)
    for problem in verdict.problems:
        print(problem)
    start = f" from line {verdict.first_seq} (earlier ones rotated away)" if verdict.first_seq else ""
    state = "intact" if verdict.ok else f"TAMPERED ({len(verdict.problems)} problems)"
    print(f"{args.file}: {verdict.lines} lines{start}, {state}; last hash {verdict.last_hash}")
    return 0 if verdict.ok else 1


def cmd_check_config(args: argparse.Namespace) -> int:
    from kvfence.audit.check_config import ConfigInputError, check, format_report, load_model_config

    try:
        model = load_model_config(args.model_config)
        engine_args = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
        report = check(args.engine, engine_args, model, args.accelerator_memory_gib, args.weights_gib)
    except ConfigInputError as e:
        print(f"kvfence check-config: {e}", file=sys.stderr)
        return 2
    if args.json:
        from dataclasses import asdict

        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfence", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--stop", action="append")
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-keys", default=None, help='JSON file {"KEY": "tenant", ...}; every request then needs a key')
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the file name)")
    p.add_argument("--max-pending", type=int, default=256,
                   help="sequences (prompts x n) in flight before 429")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body accepted")
    p.add_argument("--stream-stall-timeout", type=float, default=30.0,
                   help="seconds a streaming client may stop reading before its request is aborted")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the --metrics-port listener")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve the metrics on a port of their own; the API's /metrics is then 404")
    p.add_argument("--role", choices=["unified", "prefill", "decode"], default="unified",
                   help="unified serves the API; prefill and decode workers sit behind `kvfence router`")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="decode role: seconds a KV pull may take")
    p.add_argument("--park-timeout", type=float, default=60.0,
                   help="prefill role: seconds computed KV waits for a decode worker before it is freed")
    p.add_argument("--internal-token-file", default=None,
                   help="file holding the cluster secret that router and workers share; every "
                        "/internal/* call needs it (required for prefill and decode workers)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("router", help="front door of prefill and decode workers (same OpenAI API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", required=True, help="prefill worker URL (repeat)")
    p.add_argument("--decode", action="append", required=True, help="decode worker URL (repeat)")
    p.add_argument("--internal-token-file", default=None,
                   help="file holding the cluster secret that router and workers share; every "
                        "/internal/* call needs it (required)")
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("cluster", help="a local router with N prefill and M decode workers",
                       description="kvfence cluster --prefill 1 --decode 1 -- [kvfence serve flags for the workers]")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="router port; workers take the next ports")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("worker_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    p = bench.add_parser("serve", help="seeded load against any OpenAI-compatible server")
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default=None, help="default: the first listed by /v1/models")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", default="16", help="in-flight requests; a comma list runs one pass per level")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-ignore-eos", action="store_true", help="for servers that reject ignore_eos")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="write a PNG of latency against load (needs matplotlib)")
    p.set_defaults(func=cmd_bench_serve)

    p = sub.add_parser("audit", help="black-box leak and consistency audit of an OpenAI-compatible server")
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", action="append", default=[], help="repeat for several tenants")
    p.add_argument("--model", default=None, help="model id (default: the first listed)")
    p.add_argument("--max-model-len", type=int, default=None, help="if the server does not report it")
    p.add_argument("--pool-tokens", type=int, default=None, help="KV pool size in tokens, if known")
    p.add_argument("--canaries", type=int, default=24, help="concurrent canary requests")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--workers", nargs="+", default=[], metavar="URL",
                   help="prefill and decode worker URLs: check from a client's position that their "
                        "internal endpoints refuse client keys")
    p.add_argument("--json", action="store_true", help="print a machine-readable report")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("verify-log", help="check a --request-log file's hash chain")
    p.add_argument("file")
    p.set_defaults(func=cmd_verify_log)

    p = sub.add_parser("check-config", help="check KV pool capacity against the advertised context",
                       description="kvfence check-config [--engine E] [--model-config F] -- ENGINE_ARGS...")
    p.add_argument("--engine", choices=["kvfence", "vllm", "sglang"], default="kvfence")
    p.add_argument("--model-config", default=None, help="config.json, model directory or GGUF file "
                   "(default: the embedded model)")
    p.add_argument("--accelerator-memory-gib", type=float, default=None, help="memory of one accelerator")
    p.add_argument("--weights-gib", type=float, default=None, help="model weights, all shards together")
    p.add_argument("--json", action="store_true")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="the engine's launch arguments, after --")
    p.set_defaults(func=cmd_check_config)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"kvfence: configuration error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a clean message for load errors
        from kvfence.engine.sampling_params import InvalidRequest
        from kvfence.model.loader import ModelLoadError

        if isinstance(e, (ModelLoadError, InvalidRequest, ValueError)):
            print(f"kvfence: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
