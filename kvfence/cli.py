"""The `kvfence` command. Every sub-command's arguments are made from the fields of its options
dataclasses (kvfence.options.option), and the options parsed go to the function that runs it."""

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import MISSING, Field, fields
from typing import Any, get_args, get_origin

from kvfence.audit.cli import (
    AuditOptions,
    CheckConfigOptions,
    run_audit,
    run_check_config,
)
from kvfence.benchmark import BenchOptions, run_bench
from kvfence.config import EngineConfig
from kvfence.disagg.cluster import ClusterOptions, run_cluster
from kvfence.disagg.router import RouterOptions, run_router
from kvfence.disagg.worker import run_serve
from kvfence.engine.request_log import VerifyLogOptions, run_verify_log
from kvfence.engine.sampling_params import SamplingParams
from kvfence.generate import SAMPLING_DEFAULTS, GenerateOptions, run_generate
from kvfence.options import default_of, field_choices, is_option, option_types, value_type
from kvfence.server.app import refusal_line
from kvfence.server.options import ServerConfig

METAVARS = {int: "N", float: "X", str: "TEXT"}
# The --help groups of the options classes that share a command with others.
GROUPS = {ServerConfig: "server", EngineConfig: "engine", SamplingParams: "sampling"}
# Where a class's values are parsed to: generate's --sampling-seed and --seed (the engine's)
# are both a field named seed.
PREFIXES = {SamplingParams: "sampling_"}


def flag_of(f: Field) -> str:
    """--max-num-seqs for max_num_seqs, --no-prefix-cache for a bool that is on by default,
    unless the field names its flag; a positional argument is named as its field."""
    if f.metadata["positional"]:
        return f.name
    if f.metadata["flag"]:
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def argument(cls: type, f: Field, prefix: str = "") -> tuple[str, dict[str, Any]]:
    """The flag (or name) and the argparse keywords, help aside, of one field of an options
    dataclass; its value is parsed to `prefix + f.name`."""
    kind, allowed, default = (
        value_type(option_types(cls)[f.name]),
        field_choices(cls, f),
        default_of(f),
    )
    positional, metavar = f.metadata["positional"], f.metadata["metavar"]
    kw: dict[str, Any] = {}
    if not positional:
        kw["dest"] = prefix + f.name
    if default is not MISSING:
        kw["default"] = default
    elif not positional:
        kw["required"] = True
    if kind is bool:
        kw["action"] = "store_false" if default else "store_true"
    elif allowed:
        kw["choices"] = allowed
    else:
        repeated = get_origin(kind) is list
        item = get_args(kind)[0] if repeated else kind
        kw["type"] = item
        if metavar or not positional:  # a positional argument is shown by its name
            kw["metavar"] = metavar or METAVARS[item]
        if repeated and positional:
            kw["nargs"] = argparse.REMAINDER
        elif repeated and f.metadata["nargs"]:  # several values after one flag
            kw.update(action="extend", nargs=f.metadata["nargs"])
        elif repeated:
            kw["action"] = "append"
    return flag_of(f), kw


def add_options(parser: Any, cls: type, prefix: str = "") -> None:
    """One argument per option field of the dataclass `cls`, on a parser or an argument group."""
    for f in filter(is_option, fields(cls)):
        flag, kw = argument(cls, f, prefix)
        # %(default)s: a command's set_defaults shows in its --help too
        shown = (
            "" if kw.get("default") in (None, []) or "action" in kw else " (default: %(default)s)"
        )
        parser.add_argument(flag, help=f.metadata["help"].replace("%", "%%") + shown, **kw)


def config_from(cls: type, args: argparse.Namespace, prefix: str = "") -> Any:
    """The options dataclass `cls` from the arguments that add_options made of its fields."""
    return cls(**{f.name: getattr(args, prefix + f.name) for f in fields(cls) if is_option(f)})


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


def add_command(
    commands: Any, name: str, run: Callable[..., int], *classes: type, **parser_kw: Any
) -> argparse.ArgumentParser:
    """The sub-command `name`, whose arguments are the fields of `classes`; parsed, they are
    handed to `run` as one instance of each class, in that order."""
    p = commands.add_parser(name, **parser_kw)
    for cls in classes:
        group = p.add_argument_group(GROUPS[cls]) if cls in GROUPS else p
        add_options(group, cls, PREFIXES.get(cls, ""))
    p.set_defaults(
        run=lambda args: run(*(config_from(c, args, PREFIXES.get(c, "")) for c in classes))
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfence",
        description="The kvfence command: generate, serve, router, cluster, bench, audit, "
        "verify-log, check-config.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = add_command(
        commands,
        "generate",
        run_generate,
        GenerateOptions,
        SamplingParams,
        EngineConfig,
        help="generate a completion for one prompt",
    )
    p.set_defaults(**{PREFIXES[SamplingParams] + k: v for k, v in SAMPLING_DEFAULTS.items()})
    add_command(
        commands,
        "serve",
        run_serve,
        ServerConfig,
        EngineConfig,
        help="serve the OpenAI-compatible API",
        description="Serve the OpenAI-compatible API (or, with --role, one worker of a "
        "disaggregated cluster).",
    )
    add_command(
        commands,
        "router",
        run_router,
        RouterOptions,
        help="front door of prefill and decode workers (same OpenAI API)",
    )
    add_command(
        commands,
        "cluster",
        run_cluster,
        ClusterOptions,
        help="a local router with N prefill and M decode workers",
        description="kvfence cluster --prefill 1 --decode 1 -- [serve flags of the workers]",
    )
    bench = commands.add_parser("bench", help="benchmarks")
    add_command(
        bench.add_subparsers(dest="bench", required=True),
        "serve",
        run_bench,
        BenchOptions,
        help="seeded load against any OpenAI-compatible server",
    )
    add_command(
        commands,
        "audit",
        run_audit,
        AuditOptions,
        help="black-box leak and consistency audit of an OpenAI-compatible server",
    )
    add_command(
        commands,
        "verify-log",
        run_verify_log,
        VerifyLogOptions,
        help="check a --request-log file's hash chain",
    )
    add_command(
        commands,
        "check-config",
        run_check_config,
        CheckConfigOptions,
        help="check KV pool capacity against the advertised context",
        description="kvfence check-config [--engine E] [--model-config F] -- ENGINE_ARGS...",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.run(args)
    except Exception as e:
        line = refusal_line(e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
