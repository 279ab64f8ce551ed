"""Engine configuration and the capacity check that refuses to start a pool too small."""
import math
import os
from dataclasses import dataclass

import torch

from kvfence.model.config import ModelConfig

GIB = 1024**3
DTYPES = ("auto", "float32", "gguf", "gguf-int8", "bfloat16")  # the linear layers' weights (model/linear.py)
# What the KV pool stores; fp8 is e4m3 with no scale factor (as vLLM's fp8 without calibrated scales).
KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
ALLOW_FAULTS_ENV = "KVFENCE_ALLOW_FAULTS"  # must be "1" for any injected fault to start


class ConfigError(ValueError):
    pass


@dataclass
class EngineConfig:
    model: str | None = None           # GGUF file or HF directory; None means the embedded default
    max_model_len: int | None = None   # None: the model's own context length
    page_size: int = 16
    num_kv_pages: int | None = None    # None: derived from kv_memory_gib
    kv_memory_gib: float = 2.0
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    device: str = "cpu"
    enforce_eager: bool = False        # GPU: no CUDA graphs for decode steps (engine/decode_graphs.py)
    num_threads: int | None = None
    kv_sentinel: str = "enforce"       # off | log | enforce
    kv_scrub: str = "off"              # off | on-free
    attention: str = "auto"            # decode attention: auto | kernel | torch (see model/kernels.py)
    dtype: str = "auto"                # linear weights: auto | float32 | gguf | gguf-int8 | bfloat16 (model/linear.py)
    kv_cache_dtype: str = "auto"       # auto (bfloat16 with --dtype bfloat16 or gguf-int8, else float32) | float32 | bfloat16 | fp8
    prefix_cache: bool = True
    scheduling: str = "fair"           # fair (weighted, per tenant: engine/scheduler.py) | fifo
    request_log: str | None = None     # tamper-evident JSON lines, one per finished request
    request_log_max_mb: float = 64.0   # the request log rotates past this size
    inject_fault: str | None = None    # test-only: "legacy-reject-path" or "truncated-transfer"
    seed: int | None = None            # unseeded sampling; None: seeded from the OS

    def resolve(self, model: ModelConfig) -> None:
        """Fill derived values and check that they agree; raise ConfigError naming the fix."""
        check_fault_allowed(self.inject_fault)
        if self.page_size < 1 or self.page_size > 1024:
            raise ConfigError(f"page size {self.page_size} must be in [1, 1024]")
        if self.max_model_len is None:
            self.max_model_len = model.max_position_embeddings
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len {self.max_model_len} must be at least 2")
        if self.max_model_len > model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.max_model_len} is over the model's {model.max_position_embeddings} "
                f"positions: lower --max-model-len to at most {model.max_position_embeddings}")
        kv_bytes_per_token = self.size_pool(model)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} is below max_num_seqs "
                f"{self.max_num_seqs}: every running request must be able to decode in one step")
        if self.kv_sentinel not in ("off", "log", "enforce"):
            raise ConfigError(f"kv_sentinel must be off, log or enforce, not '{self.kv_sentinel}'")
        if self.scheduling not in ("fair", "fifo"):
            raise ConfigError(f"scheduling must be fair or fifo, not '{self.scheduling}'")
        if self.kv_scrub not in ("off", "on-free"):
            raise ConfigError(f"kv_scrub must be off or on-free, not '{self.kv_scrub}'")
        if self.attention not in ("auto", "kernel", "torch"):
            raise ConfigError(f"attention must be auto, kernel or torch, not '{self.attention}'")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not '{self.dtype}'")
        check_device(self.device)
        if self.dtype.startswith("gguf") and self.device != "cpu":
            raise ConfigError(f"--dtype {self.dtype} runs on the CPU only: use --dtype float32 or bfloat16 on a GPU")
        if self.attention == "kernel" and self.device != "cpu":
            raise ConfigError("the attention kernel runs on the CPU only: use --attention auto or torch")
        if self.inject_fault != "legacy-reject-path":
            check_capacity(self.num_kv_pages, self.page_size, self.max_model_len, kv_bytes_per_token)

    def size_pool(self, model: ModelConfig) -> int:
        """Fills in the KV dtype `auto` stands for and the page count kv_memory_gib holds;
        returns the KV bytes per token. `kvfence check-config` sizes the pool through this too."""
        if self.kv_cache_dtype not in ("auto", *KV_CACHE_DTYPES):
            raise ConfigError(f"kv_cache_dtype must be auto, float32, bfloat16 or fp8, not '{self.kv_cache_dtype}'")
        if self.kv_cache_dtype == "auto":  # the exact modes stay exact
            self.kv_cache_dtype = "bfloat16" if self.dtype in ("bfloat16", "gguf-int8") else "float32"
        kv_bytes_per_token = model.kv_bytes_per_token(self.kv_element_size)
        if self.num_kv_pages is None:
            self.num_kv_pages = int(self.kv_memory_gib * GIB // (kv_bytes_per_token * self.page_size))
        return kv_bytes_per_token

    @property
    def kv_element_size(self) -> int:
        return KV_CACHE_DTYPES[self.kv_cache_dtype].itemsize


def check_fault_allowed(fault: str | None) -> None:
    """A test-only fault starts only where the environment says this is a test: a flag alone,
    copied into a deployment, must not re-create a leak."""
    if fault and os.environ.get(ALLOW_FAULTS_ENV) != "1":
        raise ConfigError(f"the injected fault {fault} (--inject-fault) is for tests only: set "
                          f"{ALLOW_FAULTS_ENV}=1 in the environment to allow it")


def check_device(device: str) -> None:
    if device == "cpu":
        return
    if device.split(":")[0] != "cuda":
        raise ConfigError(f"device must be cpu or cuda (cuda:N), not '{device}'")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {device} was asked for but this torch ({torch.__version__}) sees no CUDA GPU: "
                          "install a CUDA build of torch on a machine with a GPU, or use --device cpu")


def check_capacity(num_pages: int, page_size: int, max_model_len: int, kv_bytes_per_token: int) -> None:
    """The pool must hold one request of the full advertised context, or nothing starts."""
    capacity = num_pages * page_size
    if capacity >= max_model_len:
        return
    need_pages = math.ceil(max_model_len / page_size)
    need_gib = need_pages * page_size * kv_bytes_per_token / GIB
    raise ConfigError(
        f"KV pool holds {capacity} tokens ({num_pages} pages of {page_size}) but max_model_len is "
        f"{max_model_len}: a full-context request could not fit. Raise --num-kv-pages to at least "
        f"{need_pages} (about {need_gib:.2f} GiB of KV; twice that is advised for concurrency) or lower "
        f"--max-model-len to at most {capacity}.")
