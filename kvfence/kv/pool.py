"""The KV pool: preallocated K and V page tensors shared by every request.

Slot `page * page_size + offset` of layer `l` holds one token's K (and V) for all KV
heads. One extra page past the allocatable ones is the scratch page: padding rows of a
batch write there and masked-out positions read from there. It is never granted to a
request, so nothing real is ever stored in it.
"""

import torch

from kvfence.model.config import ModelConfig


class KVPool:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        slots = (num_pages + 1) * page_size
        shape = (config.num_layers, slots, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Each layer's (K, V) views, made once: indexing the pool per layer and step costs a
        # dispatch each.
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))
        self.scratch_slot = num_pages * page_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def scrub(self, pages: list[int]) -> None:
        """Zero whole pages (all layers, K and V)."""
        if not pages:
            return
        idx = torch.tensor(pages, device=self.k.device)
        view_k = self.k.view(self.k.shape[0], self.num_pages + 1, self.page_size, *self.k.shape[2:])
        view_v = self.v.view(view_k.shape)
        view_k[:, idx] = 0
        view_v[:, idx] = 0
