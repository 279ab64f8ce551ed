"""Validates a deployment's KV capacity against its advertised context, before traffic.

Reads kvfence, vLLM or SGLang launch arguments (ENGINES: each engine's flags, one entry) plus
the model's shape (config.json or a GGUF file) and, where the pool is sized from memory, the
accelerator's memory; computes KV bytes per token and the pool's capacity in tokens; names
every mismatch and its fix.
"""

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvfence.audit import capacity
from kvfence.audit.model_shape import ModelShape, read_model_shape
from kvfence.default_model import find_default_model

# vLLM's and SGLang's KV dtypes; auto (the model's dtype) and a name not here: 16 bits
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


@dataclass(frozen=True)
class EngineFlags:
    """The launch flags with which an engine sizes its KV pool, and the engine's defaults."""

    name: str  # as messages name the engine
    context: str  # the advertised context length
    pool: str  # the pool's size in pages (in tokens, for an engine without page_size)
    kv_dtype: str
    kv_dtype_bytes: dict[str, int]
    unknown_kv_dtype_bytes: int | None  # a KV dtype not in kv_dtype_bytes; None: refused
    page_size: str | None = None
    default_page_size: int = 1
    # The weights' dtype, and the KV dtype that auto takes given it; None: auto is a KV dtype
    weights_dtype: str | None = None
    auto_kv_dtype: Callable[[str], str] | None = None
    memory: str | None = None  # the pool's memory on one GPU, in memory_unit bytes
    memory_unit: int = 1
    default_memory: float | None = None  # None: sized from a fraction of accelerator memory
    fraction: str | None = None  # the share of accelerator memory for weights and KV
    default_fraction: float = 0.9
    tensor_parallel: tuple[str, ...] = ()  # the GPUs that share each layer's KV heads
    more_memory: str | None = None  # other ways to a larger pool, named in the fix


ENGINES = {
    "kvfence": EngineFlags(
        name="kvfence",
        context="--max-model-len",
        pool="--num-kv-pages",
        kv_dtype="--kv-cache-dtype",
        kv_dtype_bytes={"float32": 4, "bfloat16": 2, "fp8": 1},
        unknown_kv_dtype_bytes=None,
        page_size="--page-size",
        default_page_size=16,
        weights_dtype="--dtype",
        # as EngineConfig.resolve_auto: bfloat16 under the weights that are not bit-equal anyway
        auto_kv_dtype=lambda dtype: "bfloat16" if dtype in ("bfloat16", "gguf-int8") else "float32",
        memory="--kv-memory-gib",
        memory_unit=capacity.GIB,
        default_memory=2.0,
    ),
    "vllm": EngineFlags(
        name="vLLM",
        context="--max-model-len",
        pool="--num-gpu-blocks-override",
        kv_dtype="--kv-cache-dtype",
        kv_dtype_bytes=DTYPE_BYTES,
        unknown_kv_dtype_bytes=2,
        page_size="--block-size",
        default_page_size=16,
        memory="--kv-cache-memory-bytes",
        fraction="--gpu-memory-utilization",
        default_fraction=0.9,
        tensor_parallel=("--tensor-parallel-size", "-tp"),
        more_memory="--gpu-memory-utilization, --kv-cache-memory-bytes or more GPUs",
    ),
    "sglang": EngineFlags(
        name="SGLang",
        context="--context-length",
        pool="--max-total-tokens",
        kv_dtype="--kv-cache-dtype",
        kv_dtype_bytes=DTYPE_BYTES,
        unknown_kv_dtype_bytes=2,
        fraction="--mem-fraction-static",
        default_fraction=0.88,
        tensor_parallel=("--tp-size", "--tp"),
        more_memory="--mem-fraction-static or more GPUs",
    ),
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


def load_model_config(path: str | None) -> ModelShape:
    """The shape of the model at `path` (config.json, its directory or a GGUF file; None: the
    embedded model)."""
    try:
        p = Path(path) if path else find_default_model("give --model-config")
        return read_model_shape(p)
    except (OSError, ValueError) as e:
        raise ConfigInputError(
            f"cannot read the model's shape from {path or 'the default model'}: {e}"
        ) from e


def _parse(argv: list[str], flags: EngineFlags) -> dict:
    """The flags of `flags` found in `argv`, keyed by flag; other flags are ignored."""
    kinds = {
        flags.context: int,
        flags.pool: int,
        flags.kv_dtype: str,
        flags.page_size: int,
        flags.weights_dtype: str,
        flags.memory: float,
        flags.fraction: float,
    } | dict.fromkeys(flags.tensor_parallel, int)
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag, kind in kinds.items():
        if flag:  # None: a flag this engine does not have
            parser.add_argument(flag, type=kind, default=None, dest=flag)
    try:
        known, _ = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ConfigInputError(f"cannot parse the engine arguments: {e}") from None
    return {k: v for k, v in vars(known).items() if v is not None}


def _kv_element_size(flags: EngineFlags, a: dict) -> int:
    kv_dtype = a.get(flags.kv_dtype, "auto")
    if kv_dtype == "auto" and flags.auto_kv_dtype:
        kv_dtype = flags.auto_kv_dtype(a.get(flags.weights_dtype, "auto"))
    if kv_dtype in flags.kv_dtype_bytes:
        return flags.kv_dtype_bytes[kv_dtype]
    if flags.unknown_kv_dtype_bytes is None:
        known = ", ".join(("auto", *flags.kv_dtype_bytes))
        raise ConfigInputError(f"{flags.kv_dtype} must be one of {known}, not '{kv_dtype}'")
    return flags.unknown_kv_dtype_bytes


def _pool_pages(
    flags: EngineFlags,
    a: dict,
    page_size: int,
    gpu_bytes_per_token: float,
    tp: int,
    accelerator_memory_gib: float | None,
    weights_gib: float | None,
) -> tuple[int, bool]:
    """The pool's pages, and whether they are estimated from the accelerator's memory."""
    if flags.pool in a:
        return a[flags.pool], False
    memory = a.get(flags.memory, flags.default_memory)
    if memory is not None:
        return capacity.pages_in(memory * flags.memory_unit, page_size, gpu_bytes_per_token), False
    if accelerator_memory_gib is None:
        raise ConfigInputError(
            f"{flags.name} sizes its KV pool from accelerator memory: give "
            "--accelerator-memory-gib (or the engine's explicit pool size)"
        )
    fraction = a.get(flags.fraction, flags.default_fraction)
    usable = accelerator_memory_gib * fraction - (weights_gib or 0) / tp
    if usable <= 0:
        raise ConfigInputError(
            f"the weights ({weights_gib} GiB over {tp} GPUs) do not fit {fraction:.0%} of "
            f"{accelerator_memory_gib} GiB"
        )
    return capacity.pages_in(usable * capacity.GIB, page_size, gpu_bytes_per_token), True


def check(
    engine: str,
    argv: list[str],
    model: ModelShape,
    accelerator_memory_gib: float | None = None,
    weights_gib: float | None = None,
) -> CapacityReport:
    if engine not in ENGINES:
        raise ConfigInputError(f"unknown engine '{engine}' ({', '.join(ENGINES)})")
    flags = ENGINES[engine]
    a = _parse(argv, flags)
    per_token = capacity.kv_bytes_per_token(model, _kv_element_size(flags, a))
    tp = next((a[flag] for flag in flags.tensor_parallel if flag in a), 1)
    page_size = a.get(flags.page_size, flags.default_page_size)
    pages, estimate = _pool_pages(
        flags, a, page_size, per_token / tp, tp, accelerator_memory_gib, weights_gib
    )
    context, pool = a.get(flags.context, model.max_position_embeddings), pages * page_size
    if context <= 0 or pool < 0 or page_size <= 0:
        raise ConfigInputError("context length, page size and pool size must be positive")

    report = CapacityReport(engine, context, pool, estimate, per_token)
    if context > model.max_position_embeddings:
        report.warnings.append(
            f"the advertised context {context:,} is beyond the model's "
            f"{model.max_position_embeddings:,} trained positions"
        )
    problem = capacity.shortfall(
        pages, page_size, context, per_token, flags.pool, flags.context, flags.more_memory
    )
    if problem:
        report.errors.append(problem)
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
