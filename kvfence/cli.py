"""The `kvfence` command: generate, serve, router, audit, check-config, bench."""

import argparse
import json
import logging
import os
import sys
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

from kvfence.audit import CHECKS as AUDIT_CHECKS
from kvfence.config import ConfigError, EngineConfig, choices, option_types, value_type
from kvfence.server.options import ServerConfig

METAVARS = {int: "N", float: "X", str: "TEXT"}


def flag_of(f: Field) -> str:
    """--max-num-seqs for max_num_seqs, --no-prefix-cache for a bool that is on by default,
    unless the field names its flag."""
    if f.metadata["flag"]:
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def argument(cls: type, f: Field) -> tuple[str, dict[str, Any]]:
    """The flag and the argparse keywords, help aside, of one field of a config dataclass."""
    annotation = option_types(cls)[f.name]
    kind, allowed = value_type(annotation), choices(annotation)
    kw: dict[str, Any] = {"dest": f.name, "default": f.default}
    if kind is bool:
        kw["action"] = "store_false" if f.default else "store_true"
    elif allowed:
        kw["choices"] = allowed
    else:
        kw.update(type=kind, metavar=f.metadata["metavar"] or METAVARS[kind])
    return flag_of(f), kw


def add_options(parser: Any, cls: type) -> None:
    """One flag per field of the config dataclass `cls`, on a parser or an argument group."""
    for f in fields(cls):
        flag, kw = argument(cls, f)
        shown = "" if f.default is None or "action" in kw else f" (default: {f.default})"
        parser.add_argument(flag, help=(f.metadata["help"] + shown).replace("%", "%%"), **kw)


def config_from(cls: type, args: argparse.Namespace) -> Any:
    """The config dataclass `cls` from the flags that add_options made of its fields."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def flags_markdown() -> str:
    """The table of `kvfence serve` flags in the README, one line per flag."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for cls in (ServerConfig, EngineConfig):
        for f in fields(cls):
            flag, kw = argument(cls, f)
            if "choices" in kw:
                flag += " " + "\\|".join(kw["choices"])
            elif "metavar" in kw:
                flag += " " + kw["metavar"]
            default = "" if f.default is None or "action" in kw else f"`{f.default}`"
            meaning = f.metadata["help"].replace("|", "\\|")  # a bare bar would end the cell
            rows.append(f"| `{flag}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def cmd_generate(args: argparse.Namespace) -> int:
    from kvfence.engine.sampling_params import SamplingParams
    from kvfence.llm import LLM

    llm = LLM(**vars(config_from(EngineConfig, args)))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop or [],
    )
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
    opts: ServerConfig = config_from(ServerConfig, args)
    config: EngineConfig = config_from(EngineConfig, args)
    keys = ApiKeys.from_file(opts.api_keys) if opts.api_keys else ApiKeys()
    try:
        public = not ipaddress.ip_address(opts.host).is_loopback
    except ValueError:
        public = opts.host != "localhost"
    if public and not keys.enabled:
        log.warning(
            "WARNING: serving on %s without API keys: anyone who can reach this address "
            "can use the model. Pass --api-keys FILE.",
            opts.host,
        )
    if opts.role != "unified":
        from kvfence.disagg import (
            read_internal_token,
            require_internal_token,
            worker_client,
        )

        token = read_internal_token(opts.internal_token_file, f"kvfence serve --role {opts.role}")
    check_fault_allowed(config.inject_fault)  # before the model loads, as the engine checks again
    resolve_model_path(config.model)  # a bad path fails here, before the server starts

    def build() -> Server:
        server = Server(
            LLMEngine(config),
            keys,
            opts.served_model_name,
            opts.max_pending,
            opts.max_body_bytes,
            stream_stall_timeout=opts.stream_stall_timeout,
            report_cached_tokens=keys.enabled or not public,
        )
        if opts.metrics_port is not None:
            server.metrics.serve(opts.metrics_host, opts.metrics_port)
            log.info("metrics on http://%s:%d/metrics", opts.metrics_host, opts.metrics_port)
        if opts.role != "unified":
            from kvfence.disagg.transfer import KVTransfer
            from kvfence.engine.faults import transfer_class

            transfer = transfer_class(KVTransfer, config.inject_fault)
            app.state.transfer = transfer(server.engine.pool, f"kvfence-{opts.role}-{opts.port}")
            app.state.http = worker_client(token)
        log.info(
            "%s on http://%s:%d: %s",
            opts.role,
            opts.host,
            opts.port,
            server.engine.describe(),
        )
        return server

    def build_or_exit() -> Server:
        """build() in the app's startup, where uvicorn would print a refusal as its own
        traceback: the line main prints instead, and the process ends before a port opens."""
        try:
            return build()
        except Exception as e:
            line = refusal_line(e)
            if line is None:
                raise
            print(line, file=sys.stderr, flush=True)
            os._exit(2)

    app = create_app(build_or_exit, role=opts.role, serve_metrics=opts.metrics_port is None)
    if opts.role != "unified":
        require_internal_token(app, token)
    if opts.role == "prefill":
        from kvfence.disagg import prefill

        prefill.add_routes(app, opts.park_timeout)
    elif opts.role == "decode":
        from kvfence.disagg import decode

        decode.add_routes(app, opts.kv_transfer_timeout)
    keep_alive = {}
    if opts.role != "unified":
        from kvfence.disagg import WORKER_KEEPALIVE_S

        keep_alive["timeout_keep_alive"] = WORKER_KEEPALIVE_S
    serve(app, opts.host, opts.port, log_level="warning", access_log=False, **keep_alive)
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kvfence.disagg import read_internal_token
    from kvfence.disagg.router import create_router

    token = read_internal_token(args.internal_token_file, "kvfence router")
    uvicorn.run(
        create_router(args.prefill, args.decode, token),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
    )
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    """N prefill and M decode workers plus a router on this machine, until interrupted."""
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
            procs.append(
                subprocess.Popen(
                    [
                        *base,
                        "serve",
                        "--role",
                        role,
                        "--port",
                        str(port),
                        "--internal-token-file",
                        token_file,
                        "--threads",
                        str(args.threads_per_worker),
                        *worker_args,
                    ]
                )
            )
            port += 1
    try:
        for url in urls["prefill"] + urls["decode"]:
            while True:
                if any(p.poll() is not None for p in procs):
                    print(
                        "kvfence cluster: a worker exited during start-up",
                        file=sys.stderr,
                    )
                    return 1
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
        router = [
            *base,
            "router",
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--internal-token-file",
            token_file,
        ]
        router += [a for u in urls["prefill"] for a in ("--prefill", u)]
        router += [a for u in urls["decode"] for a in ("--decode", u)]
        procs.append(subprocess.Popen(router))
        logging.getLogger("kvfence").info(
            "cluster up: router on %s:%d, prefill %s, decode %s",
            args.host,
            args.port,
            urls["prefill"],
            urls["decode"],
        )
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

    from kvfence.audit.auditor import AuditError, Auditor
    from kvfence.audit.report import format_report, junit_xml

    if not args.base_url and not args.workers:
        print(
            "kvfence audit: give --base-url URL, --workers URL ..., or both",
            file=sys.stderr,
        )
        return 2
    checks = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    unknown = sorted(set(checks) - set(AUDIT_CHECKS))
    if unknown:
        print(f"kvfence audit: unknown --checks {', '.join(unknown)}", file=sys.stderr)
        return 2
    auditor = Auditor(
        args.base_url,
        args.api_key,
        args.model,
        args.max_model_len,
        args.pool_tokens,
        args.canaries,
        args.concurrency,
        progress=not args.json,
        seed=args.seed,
        workers=args.workers,
        checks=checks,
        budget_minutes=args.budget_minutes,
        alpha=args.alpha,
        cache_min_tokens=args.cache_min_tokens,
    )
    try:
        report = asyncio.run(auditor.run())
    except AuditError as e:
        print(f"kvfence audit: could not run: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    if args.junit_xml:
        Path(args.junit_xml).write_text(junit_xml(report))
    return report.exit_code(args.strict)


def cmd_verify_log(args: argparse.Namespace) -> int:
    from kvfence.engine.request_log import verify

    verdict = verify(args.file)
    for problem in verdict.problems:
        print(problem)
    start = (
        f" from line {verdict.first_seq} (earlier ones rotated away)" if verdict.first_seq else ""
    )
    state = "intact" if verdict.ok else f"TAMPERED ({len(verdict.problems)} problems)"
    print(f"{args.file}: {verdict.lines} lines{start}, {state}; last hash {verdict.last_hash}")
    return 0 if verdict.ok else 1


def cmd_check_config(args: argparse.Namespace) -> int:
    from kvfence.audit.check_config import (
        ConfigInputError,
        check,
        format_report,
        load_model_config,
    )

    try:
        model = load_model_config(args.model_config)
        engine_args = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
        report = check(
            args.engine,
            engine_args,
            model,
            args.accelerator_memory_gib,
            args.weights_gib,
        )
    except ConfigInputError as e:
        print(f"kvfence check-config: {e}", file=sys.stderr)
        return 2
    if args.json:
        from dataclasses import asdict

        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
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
    add_options(p.add_argument_group("engine"), EngineConfig)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        description="Serve the OpenAI-compatible API (or, with --role, one worker "
        "of a disaggregated cluster).",
    )
    add_options(p.add_argument_group("server"), ServerConfig)
    add_options(p.add_argument_group("engine"), EngineConfig)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("router", help="front door of prefill and decode workers (same OpenAI API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", required=True, help="prefill worker URL (repeat)")
    p.add_argument("--decode", action="append", required=True, help="decode worker URL (repeat)")
    p.add_argument(
        "--internal-token-file",
        default=None,
        help="file holding the cluster secret that router and workers share; every "
        "/internal/* call needs it (required)",
    )
    p.set_defaults(func=cmd_router)

    p = sub.add_parser(
        "cluster",
        help="a local router with N prefill and M decode workers",
        description="kvfence cluster --prefill 1 --decode 1 -- [serve flags of the workers]",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="router port; workers take the next ports",
    )
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
    p.add_argument(
        "--concurrency",
        default="16",
        help="in-flight requests; a comma list runs one pass per level",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second instead",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="for servers that reject ignore_eos",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--plot",
        default=None,
        help="write a PNG of latency against load (needs matplotlib)",
    )
    p.set_defaults(func=cmd_bench_serve)

    p = sub.add_parser(
        "audit",
        help="black-box leak and consistency audit of an OpenAI-compatible server",
    )
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", action="append", default=[], help="repeat for several tenants")
    p.add_argument("--model", default=None, help="model id (default: the first listed)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="if the server does not report it",
    )
    p.add_argument("--pool-tokens", type=int, default=None, help="KV pool size in tokens, if known")
    p.add_argument("--canaries", type=int, default=24, help="concurrent canary requests")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--workers",
        nargs="+",
        default=[],
        metavar="URL",
        help="prefill and decode worker URLs: check from a client's position that their "
        "internal endpoints refuse client keys",
    )
    p.add_argument(
        "--checks",
        default=",".join(AUDIT_CHECKS),
        help=f"comma-separated checks to run, of {', '.join(AUDIT_CHECKS)} (default: all)",
    )
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=10.0,
        help="time the audit may take; the prefix-cache test stops at it, decided or not",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=0.01,
        help="significance level of the prefix-cache test, shared among the pairs of keys "
        "and the test's looks",
    )
    p.add_argument(
        "--cache-min-tokens",
        type=int,
        default=1024,
        help="shortest prompt of the prefix-cache test (within the context): caches share "
        "whole blocks, or only long prompts",
    )
    p.add_argument("--json", action="store_true", help="print a machine-readable report")
    p.add_argument("--junit-xml", metavar="FILE", help="also write the report as JUnit XML")
    p.add_argument(
        "--strict", action="store_true", help="exit 1 on inconclusive checks too, not only findings"
    )
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("verify-log", help="check a --request-log file's hash chain")
    p.add_argument("file")
    p.set_defaults(func=cmd_verify_log)

    p = sub.add_parser(
        "check-config",
        help="check KV pool capacity against the advertised context",
        description="kvfence check-config [--engine E] [--model-config F] -- ENGINE_ARGS...",
    )
    p.add_argument("--engine", choices=["kvfence", "vllm", "sglang"], default="kvfence")
    p.add_argument(
        "--model-config",
        default=None,
        help="config.json, model directory or GGUF file (default: the embedded model)",
    )
    p.add_argument(
        "--accelerator-memory-gib",
        type=float,
        default=None,
        help="memory of one accelerator",
    )
    p.add_argument(
        "--weights-gib",
        type=float,
        default=None,
        help="model weights, all shards together",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "engine_args",
        nargs=argparse.REMAINDER,
        help="the engine's launch arguments, after --",
    )
    p.set_defaults(func=cmd_check_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except Exception as e:
        line = refusal_line(e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


def refusal_line(e: Exception) -> str | None:
    """A configuration or load error as the one line it is printed as, not a traceback; None
    for any other exception."""
    from kvfence.engine.sampling_params import InvalidRequest
    from kvfence.model.loader import ModelLoadError

    if isinstance(e, ConfigError):
        return f"kvfence: configuration error: {e}"
    if isinstance(e, (ModelLoadError, InvalidRequest, ValueError)):
        return f"kvfence: {e}"
    return None


if __name__ == "__main__":
    sys.exit(main())
