"""Validates a deployment's KV capacity against its advertised context, before traffic.

Reads kvfence, vLLM or SGLang launch arguments plus the model's shape (config.json or a
GGUF file) and, where the pool is sized from memory, the accelerator's memory; computes
KV bytes per token and the pool's capacity in tokens; names every mismatch and its fix.
"""

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvfence.config import GIB, ConfigError, EngineConfig
from kvfence.model.config import ModelConfig

DTYPE_BYTES = {
    "auto": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp32": 4,
    "float32": 4,
}


class ConfigInputError(ValueError):
    pass


@dataclass
class CapacityReport:
    engine: str
    context_tokens: int
    pool_tokens: int
    pool_is_estimate: bool
    kv_bytes_per_token: int
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def load_model_config(path: str | None) -> ModelConfig:
    from kvfence.model.loader import (
        ModelLoadError,
        default_model_path,
        gguf_model_config,
        hf_model_config,
        open_gguf,
    )

    p = Path(path) if path else default_model_path()
    try:
        if p.is_dir():
            p = p / "config.json"
        if p.suffix == ".gguf":
            return gguf_model_config(open_gguf(p))
        return hf_model_config(json.loads(p.read_text()))
    except (OSError, ValueError, KeyError, ModelLoadError) as e:
        raise ConfigInputError(f"cannot read the model's shape from {p}: {e}") from e


def _parse(argv: list[str], spec: dict[str, type]) -> dict:
    """The flags of `spec` found in `argv`, keyed by flag; other flags are ignored."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag, kind in spec.items():
        parser.add_argument(flag, type=kind, default=None, dest=flag)
    try:
        known, _ = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ConfigInputError(f"cannot parse the engine arguments: {e}") from None
    return {k: v for k, v in vars(known).items() if v is not None}


def _memory_pool(
    mem_gib: float | None,
    fraction: float,
    weights_gib: float | None,
    tp: int,
    per_gpu_bytes_per_token: float,
    what: str,
) -> int:
    if mem_gib is None:
        raise ConfigInputError(
            f"{what} sizes its KV pool from accelerator memory: give --accelerator-memory-gib "
            "(or the engine's explicit pool size)"
        )
    usable = mem_gib * fraction - (weights_gib or 0) / tp
    if usable <= 0:
        raise ConfigInputError(
            f"the weights ({weights_gib} GiB over {tp} GPUs) do not fit {fraction:.0%} of "
            f"{mem_gib} GiB"
        )
    return int(usable * GIB / per_gpu_bytes_per_token)


def check(
    engine: str,
    argv: list[str],
    model: ModelConfig,
    accelerator_memory_gib: float | None = None,
    weights_gib: float | None = None,
) -> CapacityReport:
    if engine == "kvfence":
        a = _parse(
            argv,
            {
                "--max-model-len": int,
                "--page-size": int,
                "--num-kv-pages": int,
                "--kv-memory-gib": float,
                "--dtype": str,
                "--kv-cache-dtype": str,
            },
        )
        fields = {
            "--page-size": "page_size",
            "--num-kv-pages": "num_kv_pages",
            "--kv-memory-gib": "kv_memory_gib",
            "--dtype": "dtype",
            "--kv-cache-dtype": "kv_cache_dtype",
        }
        try:
            config = EngineConfig(**{name: a[flag] for flag, name in fields.items() if flag in a})
            # whether the GGUF blocks would run there changes dtype's auto, not the KV dtype's
            config.resolve_auto(gguf_blocks_run=False)
            per_token = config.size_pool(model)  # as `kvfence serve` sizes it
        except ConfigError as e:
            raise ConfigInputError(str(e)) from None
        context = a.get("--max-model-len", model.max_position_embeddings)
        pool, estimate = config.num_kv_pages * config.page_size, False
        fix_flag = "--num-kv-pages (or --kv-memory-gib)"
        context_flag = "--max-model-len"
    elif engine == "vllm":
        a = _parse(
            argv,
            {
                "--max-model-len": int,
                "--gpu-memory-utilization": float,
                "--kv-cache-dtype": str,
                "--tensor-parallel-size": int,
                "-tp": int,
                "--block-size": int,
                "--num-gpu-blocks-override": int,
                "--kv-cache-memory-bytes": int,
            },
        )
        tp = a.get("--tensor-parallel-size", a.get("-tp", 1))
        per_token = model.kv_bytes_per_token(DTYPE_BYTES.get(a.get("--kv-cache-dtype", "auto"), 2))
        context = a.get("--max-model-len", model.max_position_embeddings)
        if "--num-gpu-blocks-override" in a:
            pool, estimate = (
                a["--num-gpu-blocks-override"] * a.get("--block-size", 16),
                False,
            )
        elif "--kv-cache-memory-bytes" in a:
            pool, estimate = int(a["--kv-cache-memory-bytes"] * tp / per_token), False
        else:
            pool = _memory_pool(
                accelerator_memory_gib,
                a.get("--gpu-memory-utilization", 0.9),
                weights_gib,
                tp,
                per_token / tp,
                "vLLM",
            )
            estimate = True
        fix_flag, context_flag = (
            "--gpu-memory-utilization / --kv-cache-memory-bytes or more GPUs",
            "--max-model-len",
        )
    elif engine == "sglang":
        a = _parse(
            argv,
            {
                "--context-length": int,
                "--max-total-tokens": int,
                "--mem-fraction-static": float,
                "--kv-cache-dtype": str,
                "--tp-size": int,
                "--tp": int,
            },
        )
        tp = a.get("--tp-size", a.get("--tp", 1))
        per_token = model.kv_bytes_per_token(DTYPE_BYTES.get(a.get("--kv-cache-dtype", "auto"), 2))
        context = a.get("--context-length", model.max_position_embeddings)
        if "--max-total-tokens" in a:
            pool, estimate = a["--max-total-tokens"], False
        else:
            pool = _memory_pool(
                accelerator_memory_gib,
                a.get("--mem-fraction-static", 0.88),
                weights_gib,
                tp,
                per_token / tp,
                "SGLang",
            )
            estimate = True
        fix_flag, context_flag = (
            "--max-total-tokens (or --mem-fraction-static, more GPUs)",
            "--context-length",
        )
    else:
        raise ConfigInputError(f"unknown engine '{engine}' (kvfence, vllm, sglang)")
    if context <= 0 or pool < 0:
        raise ConfigInputError("context length and pool size must be positive")

    report = CapacityReport(engine, context, pool, estimate, per_token)
    if context > model.max_position_embeddings:
        report.warnings.append(
            f"the advertised context {context:,} is beyond the model's "
            f"{model.max_position_embeddings:,} trained positions"
        )
    if pool < context:
        report.errors.append(
            f"the KV pool holds {pool:,} tokens but the advertised context is {context:,} tokens: "
            f"a prompt between the two cannot be served. "
            f"Raise the pool with {fix_flag} to at least {context:,} tokens "
            f"(about {2 * context:,} advised, {2 * context * per_token / GIB:.1f} GiB of KV) "
            f"or lower {context_flag} below {pool:,}."
        )
    elif pool < 2 * context:
        report.warnings.append(
            f"the pool ({pool:,} tokens) holds one full-context request but less than two "
            f"({2 * context:,} tokens); long requests will queue behind each other"
        )
    if estimate:
        report.notes.append(
            "the pool size is estimated from memory; the engine's start-up log has the exact figure"
        )
    report.notes.append(
        f"KV bytes per token: {per_token:,} ({model.num_layers} layers x {model.num_kv_heads} KV "
        f"heads x {model.head_dim} dims x 2 (K and V))"
    )
    return report


def format_report(r: CapacityReport) -> str:
    lines = [
        f"{r.engine}: advertised context {r.context_tokens:,} tokens, KV pool "
        f"{'~' if r.pool_is_estimate else ''}{r.pool_tokens:,} tokens"
    ]
    lines += [f"  ERROR    {e}" for e in r.errors]
    lines += [f"  WARNING  {w}" for w in r.warnings]
    lines += [f"  note     {n}" for n in r.notes]
    lines.append("verdict: " + ("OK" if r.ok else "MISMATCH"))
    return "\n".join(lines)
