"""What an auditor runs: `kvfence audit` (a server from outside) and `kvfence check-config` (a
deployment's launch arguments); each command's options, and the function that runs it."""

import asyncio
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvfence.audit import CHECKS, check_config
from kvfence.audit.report import format_report, junit_xml
from kvfence.options import option


@dataclass
class AuditOptions:
    base_url: str | None = option(None, "server root, e.g. http://127.0.0.1:8000", metavar="URL")
    api_key: list[str] = option([], "repeat for several tenants", metavar="KEY")
    model: str | None = option(None, "model id (default: the first listed)", metavar="ID")
    max_model_len: int | None = option(None, "if the server does not report it")
    pool_tokens: int | None = option(None, "KV pool size in tokens, if known")
    canaries: int = option(24, "concurrent canary requests")
    concurrency: int = option(16, "most requests in flight at once")
    seed: int | None = option(None, "seed of the audit's prompts and choices")
    workers: list[str] = option(
        [],
        "prefill and decode worker URLs: check from a client's position that their internal "
        "endpoints refuse client keys",
        metavar="URL",
        nargs="+",
    )
    checks: str = option(",".join(CHECKS), "comma-separated checks to run")
    budget_minutes: float = option(
        10.0, "time the audit may take; the prefix-cache test stops at it, decided or not"
    )
    alpha: float = option(
        0.01,
        "significance level of the prefix-cache test, shared among the pairs of keys and the "
        "test's looks",
    )
    cache_min_tokens: int = option(
        1024,
        "shortest prompt of the prefix-cache test (within the context): caches share whole "
        "blocks, or only long prompts",
    )
    json: bool = option(False, "print a machine-readable report")
    junit_xml: str | None = option(None, "also write the report as JUnit XML", metavar="FILE")
    strict: bool = option(False, "exit 1 on inconclusive checks too, not only findings")


@dataclass
class CheckConfigOptions:
    engine: str = option(
        "kvfence",
        "the engine whose launch arguments follow",
        choices="kvfence.audit.check_config:ENGINES",
    )
    model_config: str | None = option(
        None,
        "config.json, model directory or GGUF file (default: the embedded model)",
        metavar="PATH",
    )
    accelerator_memory_gib: float | None = option(None, "memory of one accelerator", metavar="GIB")
    weights_gib: float | None = option(None, "model weights, all shards together", metavar="GIB")
    json: bool = option(False, "print a machine-readable report")
    engine_args: list[str] = option([], "the engine's launch arguments, after --", positional=True)


def run_audit(options: AuditOptions) -> int:
    from kvfence.audit.auditor import AuditError, Auditor  # scipy: a second to load, here only

    if not options.base_url and not options.workers:
        print("kvfence audit: give --base-url URL, --workers URL ..., or both", file=sys.stderr)
        return 2
    checks = tuple(c.strip() for c in options.checks.split(",") if c.strip())
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        print(f"kvfence audit: unknown --checks {', '.join(unknown)}", file=sys.stderr)
        return 2
    auditor = Auditor(
        options.base_url,
        options.api_key,
        options.model,
        options.max_model_len,
        options.pool_tokens,
        options.canaries,
        options.concurrency,
        progress=not options.json,
        seed=options.seed,
        workers=options.workers,
        checks=checks,
        budget_minutes=options.budget_minutes,
        alpha=options.alpha,
        cache_min_tokens=options.cache_min_tokens,
    )
    try:
        report = asyncio.run(auditor.run())
    except AuditError as e:
        print(f"kvfence audit: could not run: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if options.json else format_report(report))
    if options.junit_xml:
        Path(options.junit_xml).write_text(junit_xml(report))
    return report.exit_code(options.strict)


def run_check_config(options: CheckConfigOptions) -> int:
    engine_args = options.engine_args
    if engine_args[:1] == ["--"]:
        engine_args = engine_args[1:]
    try:
        model = check_config.load_model_config(options.model_config)
        report = check_config.check(
            options.engine,
            engine_args,
            model,
            options.accelerator_memory_gib,
            options.weights_gib,
        )
    except check_config.ConfigInputError as e:
        print(f"kvfence check-config: {e}", file=sys.stderr)
        return 2
    print(
        json.dumps({**asdict(report), "ok": report.ok}, indent=2)
        if options.json
        else check_config.format_report(report)
    )
    return 0 if report.ok else 1
