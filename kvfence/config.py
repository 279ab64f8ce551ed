"""Engine configuration and the capacity check that refuses to start a pool too small.

Every option is a dataclass field declared with kvfence.options.option: kvfence.cli builds the
flags and the README's flag table from them, and `check_choices` validates every choice from
the annotations.
"""

import os
from dataclasses import dataclass, fields
from types import NoneType
from typing import Any, Literal, get_args

import torch

from kvfence.audit import capacity
from kvfence.model.config import ModelConfig
from kvfence.options import field_choices, option, option_types

# What the KV pool stores; fp8 is e4m3 with no scale factor (as vLLM's fp8 without calibrated
# scales).
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}
KVCacheDtype = Literal[("auto", *KV_CACHE_DTYPES)]
# The linear layers' weights (model/linear.py).
Dtype = Literal["auto", "float32", "gguf", "gguf-int8", "bfloat16"]
ALLOW_FAULTS_ENV = "KVFENCE_ALLOW_FAULTS"  # must be "1" for any injected fault to start


class ConfigError(ValueError):
    pass


def check_choices(config: Any) -> None:
    """Every choice option of a config dataclass holds one of its values, or None where the
    annotation allows None."""
    for f in fields(config):
        value = getattr(config, f.name)
        if value is None and NoneType in get_args(option_types(type(config))[f.name]):
            continue
        allowed = field_choices(type(config), f)
        if allowed is None or value in allowed:
            continue
        name = f.name
        # past four values, "a, b, c or d" reads worse than a plain list
        listed = (
            f"one of {', '.join(allowed)}"
            if len(allowed) > 4
            else f"{', '.join(allowed[:-1])} or {allowed[-1]}"
        )
        raise ConfigError(f"{name} must be {listed}, not '{value}'")


@dataclass
class EngineConfig:
    model: str | None = option(
        None,
        "GGUF file or Hugging Face safetensors directory of a supported model (see Supported "
        "models; default: the embedded SmolLM2-135M-Instruct)",
        metavar="PATH",
    )
    max_model_len: int | None = option(None, "advertised context length (default: the model's)")
    page_size: int = option(16, "tokens per KV page")
    num_kv_pages: int | None = option(None, "KV pool size in pages (default: from --kv-memory-gib)")
    kv_memory_gib: float = option(
        2.0, "KV pool memory budget when --num-kv-pages is not given", metavar="GIB"
    )
    max_num_seqs: int = option(128, "most requests running at once")
    max_num_batched_tokens: int = option(
        512, "token budget of one step (chunked prefill); at least --max-num-seqs"
    )
    device: str = option(
        "cpu",
        "cpu or cuda (cuda:N; needs a CUDA build of torch); "
        "disaggregated workers run on the CPU only",
        metavar="DEVICE",
    )
    enforce_eager: bool = option(
        False,
        "GPU: launch a decode step's kernels one by one instead of replaying a CUDA graph",
    )
    num_threads: int | None = option(
        None,
        "CPU threads of the kernels and of torch (default: torch's, one per core)",
        flag="--threads",
    )
    kv_sentinel: Literal["off", "log", "enforce"] = option(
        "enforce", "check KV page ownership before every step"
    )
    kv_scrub: Literal["off", "on-free"] = option("off", "zero KV pages when they are freed")
    attention: Literal["auto", "kernel", "torch"] = option(
        "auto",
        "attention: a C++ kernel reading the pool in place (CPU, built at install) or "
        "pages gathered in PyTorch (any device); auto takes the kernel where it is installed",
    )
    dtype: Dtype = option(
        "auto",
        "linear weights: gguf keeps a GGUF file's blocks and gives float32's bits (CPU); "
        "gguf-int8 and bfloat16 are faster but not bit-equal; auto takes gguf where it "
        "runs, else float32; see docs/precision.md",
    )
    kv_cache_dtype: KVCacheDtype = option(
        "auto",
        "KV pool storage: bfloat16 holds twice float32's tokens, fp8 (e4m3, unscaled) four "
        "times; auto takes bfloat16 with --dtype bfloat16 or gguf-int8, else float32; "
        "disaggregated workers must agree; see docs/precision.md",
    )
    prefix_cache: bool = option(True, "disable the per-tenant prefix cache")
    scheduling: Literal["fair", "fifo"] = option(
        "fair",
        "fair: prefill work goes to the tenant with the least weighted service so far "
        "(weights from --api-keys), and while several tenants are present steps stay short "
        "and a newcomer's request gets one of its own; fifo: first come first served across "
        "tenants",
    )
    request_log: str | None = option(
        None,
        "append one hash-chained JSON line per finished request (never its text); "
        "kvfence verify-log FILE checks it",
        metavar="FILE",
    )
    request_log_max_mb: float = option(
        64.0,
        "rotate the request log past this size (FILE.1, FILE.2, ...; the chain continues)",
        metavar="MB",
    )
    inject_fault: str | None = option(
        None,
        "TEST ONLY: re-create a known KV leak (testing/faults.py); refused unless "
        f"{ALLOW_FAULTS_ENV}=1 is in the environment",
        choices="kvfence.testing.faults:FAULTS",
    )
    seed: int | None = option(None, "seed of unseeded sampling (default: from the OS)")

    # Whether the GGUF blocks run here, as resolve_auto was told; not an option.
    _gguf_blocks_run = False

    def __post_init__(self) -> None:
        check_choices(self)

    def resolve_auto(self, gguf_blocks_run: bool) -> None:
        """Makes `auto` concrete, given whether a GGUF file's blocks run on this device.
        dtype: gguf where they run (float32's results from a sixth to a third of the bytes), else
        float32. kv_cache_dtype: bfloat16 under the modes that are not bit-equal anyway
        (bfloat16, gguf-int8), else float32, so the exact modes stay exact. Idempotent."""
        self._gguf_blocks_run = gguf_blocks_run
        if self.dtype == "auto":
            self.dtype = "gguf" if gguf_blocks_run else "float32"
        if self.kv_cache_dtype == "auto":
            inexact = self.dtype in ("bfloat16", "gguf-int8")
            self.kv_cache_dtype = "bfloat16" if inexact else "float32"

    @property
    def keeps_blocks(self) -> bool:
        """Whether the loader keeps the GGUF blocks (once resolve_auto ran): the gguf modes run on
        them, and bfloat16 does where they run, for the small batches that the kernel serves."""
        return self.dtype.startswith("gguf") or (self.dtype == "bfloat16" and self._gguf_blocks_run)

    def resolve(self, model: ModelConfig) -> None:
        """Fill derived values and check that they agree; raise ConfigError naming the fix."""
        check_choices(self)
        check_fault_allowed(self.inject_fault)
        if "auto" in (self.dtype, self.kv_cache_dtype):  # no engine resolved them
            self.resolve_auto(gguf_blocks_run=False)
        if self.page_size < 1 or self.page_size > 1024:
            raise ConfigError(f"page size {self.page_size} must be in [1, 1024]")
        limit, what = model.max_position_embeddings, "positions"
        if model.sliding_window is not None and model.sliding_window < limit:
            # within the window, sliding attention is full attention; beyond it, it is not run
            limit, what = model.sliding_window, "sliding_window (not implemented beyond it)"
        if self.max_model_len is None:
            self.max_model_len = limit
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len {self.max_model_len} must be at least 2")
        if self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len {self.max_model_len} is over the model's {limit} {what}: "
                f"lower --max-model-len to at most {limit}"
            )
        kv_bytes_per_token = self.size_pool(model)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} is below max_num_seqs "
                f"{self.max_num_seqs}: every running request must be able to decode in one step"
            )
        check_device(self.device)
        if self.dtype.startswith("gguf") and self.device != "cpu":
            raise ConfigError(
                f"--dtype {self.dtype} runs on the CPU only: use --dtype float32 or "
                "bfloat16 on a GPU"
            )
        if self.attention == "kernel" and self.device != "cpu":
            raise ConfigError(
                "the attention kernel runs on the CPU only: use --attention auto or torch"
            )
        if self.inject_fault != "legacy-reject-path":
            check_capacity(
                self.num_kv_pages,
                self.page_size,
                self.max_model_len,
                kv_bytes_per_token,
            )

    def size_pool(self, model: ModelConfig) -> int:
        """Fills in the page count kv_memory_gib holds, once kv_cache_dtype is concrete
        (resolve_auto); returns the KV bytes per token."""
        per_token = capacity.kv_bytes_per_token(model, self.kv_element_size)
        if self.num_kv_pages is None:
            memory = self.kv_memory_gib * capacity.GIB
            self.num_kv_pages = capacity.pages_in(memory, self.page_size, per_token)
        return per_token

    @property
    def kv_element_size(self) -> int:
        return KV_CACHE_DTYPES[self.kv_cache_dtype].itemsize


def check_fault_allowed(fault: str | None) -> None:
    """A test-only fault starts only where the environment says this is a test: a flag alone,
    copied into a deployment, must not re-create a leak."""
    if fault and os.environ.get(ALLOW_FAULTS_ENV) != "1":
        raise ConfigError(
            f"the injected fault {fault} (--inject-fault) is for tests only: set "
            f"{ALLOW_FAULTS_ENV}=1 in the environment to allow it"
        )


def check_device(device: str) -> None:
    if device == "cpu":
        return
    if device.split(":")[0] != "cuda":
        raise ConfigError(f"device must be cpu or cuda (cuda:N), not '{device}'")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {device} was asked for but this torch ({torch.__version__}) "
            "sees no CUDA GPU: install a CUDA build of torch on a machine with a "
            "GPU, or use --device cpu"
        )


def check_capacity(
    num_pages: int, page_size: int, max_model_len: int, kv_bytes_per_token: int
) -> None:
    """The pool must hold one request of the full advertised context, or nothing starts."""
    problem = capacity.shortfall(
        num_pages, page_size, max_model_len, kv_bytes_per_token, "--num-kv-pages", "--max-model-len"
    )
    if problem:
        raise ConfigError(problem)
