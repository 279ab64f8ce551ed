"""Page allocator with ownership records.

Every page is free or has exactly one owner: a request (its integer owner id) or the
prefix cache (PREFIX_OWNER, with a reference count of the requests that read it). Each
free gives the page a fresh generation from one counter for the whole pool, so every
(page, generation) pair names one page lifetime: an entry granted before a free, or an
entry copied from another request's table, never matches what was recorded at grant.
`written` counts the slots of a page its owner has filled, so nobody can read a slot that
was not written for them. A prefix-cache page also records the
tenant that cached it and which requests hold its references, for the sentinel to check.
A page whose KV a transfer may still read (a parked prefill's, until its reader is done or
its lease ends) is lent with the generation it had: the record outlives the page's owner, so
the sentinel sees a page reissued while a reader may still be copying it. Reading a lent page
in its own lifetime (a prefix-cache hit on a parked prefill's pages) is no reuse.
"""

import time
from collections import deque

import numpy as np

FREE = -1
PREFIX_OWNER = -2
NO_TENANT = -1


class OwnershipError(RuntimeError):
    """A page was freed or handed over by someone who does not own it: a bug, never ignored."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.owner = np.full(num_pages, FREE, dtype=np.int64)
        self.generation = np.arange(num_pages, dtype=np.int64)
        self._next_generation = num_pages
        self.written = np.zeros(num_pages, dtype=np.int64)
        self.refcount = np.zeros(num_pages, dtype=np.int64)
        # Shared pages: the tenant whose prefix cache holds each (a number, see tenant_number),
        # and which requests hold their references.
        self.tenant = np.full(num_pages, NO_TENANT, dtype=np.int64)
        self.references: dict[int, list[int]] = {}  # owner -> shared pages it holds, in table order
        self._tenant_numbers: dict[str, int] = {}
        self.lent_until = np.zeros(num_pages)  # monotonic time until which a transfer may read
        self.lent_generation = np.full(num_pages, -1, dtype=np.int64)
        # A stack: the most recently freed pages, still warm in cache, are reused first.
        self._free = deque(reversed(range(num_pages)))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, owner: int, count: int) -> list[int]:
        if count > len(self._free):
            raise OwnershipError(f"asked for {count} pages with {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            if self.owner[p] != FREE:
                raise OwnershipError(f"page {p} on the free list is owned by {self.owner[p]}")
            self.owner[p] = owner
            self.written[p] = 0
        return pages

    def grant(self, owner: int, table: list[int], generations: list[int], count: int) -> None:
        """Allocates `count` pages to `owner` and appends them to its block table with their
        generations: the only way pages enter a block table, so the sentinel can check each
        entry against the lifetime it was granted in."""
        self.attach(table, generations, self.allocate(owner, count))

    def attach(self, table: list[int], generations: list[int], pages: list[int]) -> None:
        """Appends pages the owner already holds (its own, or shared pages it took
        references on) with their current generations."""
        table.extend(pages)
        generations.extend(self.generation[pages].tolist())

    def free_owner(self, owner: int) -> list[int]:
        """Releases every page the records say `owner` holds; returns them. Going by the
        records rather than the request's block table means a corrupted table can neither
        leak a page nor free someone else's."""
        released = np.nonzero(self.owner == owner)[0].tolist()
        for p in reversed(released):
            self._release(p)
        return released

    def _release(self, page: int) -> None:
        self.owner[page] = FREE
        self.generation[page] = self._next_generation
        self._next_generation += 1
        self.written[page] = 0
        self.refcount[page] = 0
        self.tenant[page] = NO_TENANT
        self._free.append(page)

    def mark_written(self, owner: int, page: int, upto: int) -> None:
        if self.owner[page] != owner:
            raise OwnershipError(f"owner {owner} wrote page {page} owned by {self.owner[page]}")
        self.written[page] = max(self.written[page], upto)

    def lend(self, pages: list[int], until: float) -> None:
        """A transfer may read `pages` until `until` (time.monotonic) or end_loan."""
        self.lent_until[pages] = until
        self.lent_generation[pages] = self.generation[pages]

    def end_loan(self, pages: list[int]) -> None:
        self.lent_until[pages] = 0.0

    def reissued_while_lent(self, pages) -> np.ndarray:
        """Per page: freed and given out again while a transfer may still read its old KV."""
        return (self.lent_until[pages] > time.monotonic()) & (
            self.generation[pages] != self.lent_generation[pages]
        )

    # --- shared prefix pages ---------------------------------------------------------

    def tenant_number(self, tenant: str) -> int:
        return self._tenant_numbers.setdefault(tenant, len(self._tenant_numbers))

    def share(self, owner: int, page: int, tenant: str) -> None:
        """Hand a request's full page to `tenant`'s prefix cache (refcount 1: the request)."""
        if self.owner[page] != owner or self.written[page] != self.page_size:
            raise OwnershipError(f"owner {owner} cannot share page {page}")
        self.owner[page] = PREFIX_OWNER
        self.refcount[page] = 1
        self.tenant[page] = self.tenant_number(tenant)
        self.references.setdefault(owner, []).append(page)

    def acquire_shared(self, page: int, owner: int) -> None:
        if self.owner[page] != PREFIX_OWNER:
            raise OwnershipError(f"page {page} is not a prefix-cache page")
        self.refcount[page] += 1
        self.references.setdefault(owner, []).append(page)

    def release_references(self, owner: int) -> list[int]:
        """Drops every reference the records say `owner` holds; returns those pages."""
        pages = self.references.pop(owner, [])
        for page in pages:
            if self.owner[page] != PREFIX_OWNER or self.refcount[page] <= 0:
                raise OwnershipError(f"page {page} released without a reference")
            self.refcount[page] -= 1
        return pages

    def holds_shared(self, owner: int, pages: list[int]) -> bool:
        """Whether `pages` are exactly the shared pages `owner` took references on, in order."""
        return self.references.get(owner, []) == pages

    def evict_shared(self, page: int) -> None:
        """The prefix cache drops a page nobody reads any more."""
        if self.owner[page] != PREFIX_OWNER or self.refcount[page] != 0:
            raise OwnershipError(f"page {page} evicted while in use")
        self._release(page)
