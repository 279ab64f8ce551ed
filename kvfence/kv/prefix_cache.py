"""Prefix cache: full prompt pages reused across requests of the same tenant.

A page is found by a chain hash over (tenant, tokens of every page up to and including
it), so tenant B can never hit, or time, a prefix only tenant A has sent. Cached pages
are owned by the cache (PREFIX_OWNER), recorded with the tenant that cached them (for the
sentinel to check whoever reads them), and reference-counted by the requests that read
them; unreferenced ones are evicted least recently used first when the pool runs short.
"""

import hashlib
from collections import OrderedDict

from kvfence.kv.allocator import PageAllocator


def page_keys(tenant: str, token_ids: list[int], page_size: int, num_pages: int) -> list[bytes]:
    keys, parent = [], hashlib.sha256(b"kvfence-prefix\0" + tenant.encode()).digest()
    for i in range(num_pages):
        chunk = token_ids[i * page_size : (i + 1) * page_size]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in chunk)).digest()
        keys.append(parent)
    return keys


def make_room(allocator: PageAllocator, cache: "PrefixCache | None", needed: int) -> bool:
    """Evicts unreferenced cached pages until `needed` pages are free; False, evicting nothing,
    where even all of them would not do."""
    evictable = cache.num_evictable if cache else 0
    if needed > allocator.num_free + evictable:
        return False
    if needed > allocator.num_free:
        cache.evict(needed - allocator.num_free)
    return True


class PrefixCache:
    def __init__(self, allocator: PageAllocator, on_evict):
        self.allocator = allocator
        self.on_evict = on_evict  # called with evicted pages (scrubbing)
        self.pages: dict[bytes, int] = {}
        self.keys: dict[int, bytes] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # pages nobody references, oldest first
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    def chain_keys(self, tenant: str, token_ids: list[int], num_pages: int) -> list[bytes]:
        return page_keys(tenant, token_ids, self.allocator.page_size, num_pages)

    def lookup(self, tenant: str, owner: int, token_ids: list[int]) -> list[int]:
        """Takes, for `owner`, a reference on the longest cached run of full pages that leaves
        at least one prompt token to compute (its logits give the first output token)."""
        ps = self.allocator.page_size
        usable = (len(token_ids) - 1) // ps
        found = []
        for key in self.chain_keys(tenant, token_ids, usable):
            page = self.pages.get(key)
            if page is None:
                break
            found.append(page)
        for page in found:
            self.allocator.acquire_shared(page, owner)
            self.lru.pop(page, None)
        self.queried_tokens += len(token_ids)
        self.hit_tokens += len(found) * ps
        return found

    def insert(
        self,
        tenant: str,
        owner: int,
        token_ids: list[int],
        block_table: list[int],
        num_shared: int,
    ) -> int:
        """Hands the request's full prompt pages after its shared ones to the cache, in
        order, while their keys are new and the request wrote them. Returns the new count of
        shared leading pages."""
        ps = self.allocator.page_size
        full = len(token_ids) // ps
        keys = self.chain_keys(tenant, token_ids, full)
        for i in range(num_shared, full):
            page = block_table[i]
            if (
                keys[i] in self.pages
                or self.allocator.owner[page] != owner
                or self.allocator.written[page] != ps
            ):
                break  # only pages this request fully wrote itself enter the cache
            self.allocator.share(owner, page, tenant)
            self.pages[keys[i]] = page
            self.keys[page] = keys[i]
            num_shared = i + 1
        return num_shared

    def release(self, owner: int) -> None:
        """Drops the references `owner` holds; pages nobody references become evictable."""
        for page in self.allocator.release_references(owner):
            if self.allocator.refcount[page] == 0:
                self.lru[page] = None

    def evict(self, count: int) -> int:
        evicted = []
        while self.lru and len(evicted) < count:
            page, _ = self.lru.popitem(last=False)
            del self.pages[self.keys.pop(page)]
            self.allocator.evict_shared(page)
            evicted.append(page)
        self.on_evict(evicted)
        return len(evicted)
