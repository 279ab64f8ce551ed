"""The KV pool's capacity arithmetic: the bytes a token's K and V take, the pages a memory
budget holds, and the refusal of a pool that cannot hold one request of the full advertised
context. The engine refuses to start on it and `kvfence check-config` reports it, so it
imports nothing of the engine (nor torch)."""

import math
from typing import Protocol

GIB = 1024**3


class KVShape(Protocol):
    """What the KV cache of a model takes a token: the engine's ModelConfig, the audit's
    ModelShape."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_bytes_per_token(model: KVShape, element_size: int) -> int:
    """K and V for every layer, `element_size` bytes a value."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * element_size


def pages_in(memory_bytes: float, page_size: int, kv_bytes_per_token: float) -> int:
    """The whole pages of `page_size` tokens that `memory_bytes` of KV memory holds."""
    return int(memory_bytes // (kv_bytes_per_token * page_size))


def shortfall(
    num_pages: int,
    page_size: int,
    context: int,
    kv_bytes_per_token: float,
    pool_flag: str,
    context_flag: str,
    more_memory: str | None = None,
) -> str | None:
    """Why a pool of `num_pages` pages cannot hold one request of `context` tokens, and its fix
    in the engine's flags (`pool_flag` counts pages; `more_memory` names other ways to a larger
    pool); None where it can."""
    capacity = num_pages * page_size
    if capacity >= context:
        return None
    need_pages = math.ceil(context / page_size)
    need_gib = need_pages * page_size * kv_bytes_per_token / GIB
    pages = f" ({num_pages:,} pages of {page_size})" if page_size > 1 else ""
    memory = f", give it more memory ({more_memory})," if more_memory else ""
    return (
        f"KV pool holds {capacity:,} tokens{pages} but the advertised context ({context_flag}) is "
        f"{context:,} tokens: a full-context request could not fit. Raise {pool_flag} to at "
        f"least {need_pages:,} (about {need_gib:.2f} GiB of KV; twice that is advised for "
        f"concurrency){memory} or lower {context_flag} to at most {capacity:,}."
    )
