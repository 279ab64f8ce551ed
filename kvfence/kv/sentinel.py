"""Runtime check of the ownership invariant, run before every forward step.

For each request in the batch: every page of its block table is owned by it (or is a
prefix-cache page of its own tenant's cache that it holds a reference to), still carries
the generation it had when it was granted, was not reissued while lent to a KV transfer that
may still read its old KV, and every position attention will read was written for this request.
"""

from typing import NamedTuple

import numpy as np

from kvfence.kv.allocator import PREFIX_OWNER, PageAllocator


class TableCheck(NamedTuple):
    """One request of a step, as the sentinel checks it."""

    owner: int
    tenant: int  # allocator.tenant_number of the request's tenant
    block_table: list[int]
    generations: list[int]  # of each page when it was granted
    num_shared: int  # leading pages borrowed from the tenant's prefix cache
    num_written: int  # positions that must already hold the request's KV
    num_tokens: int  # positions the step writes and reads


def check_block_table(
    allocator: PageAllocator,
    owner: int,
    tenant: int,
    block_table: list[int],
    generations: list[int],
    num_shared: int,
    num_written: int,
    num_tokens: int,
) -> str | None:
    """Returns None when the request may write and read positions [0, num_tokens), of which
    [0, num_written) must already hold its KV; else says what is wrong.

    The first `num_shared` pages are prefix-cache pages of the request's tenant (its number,
    allocator.tenant_number) that the request holds references to.
    """
    ps = allocator.page_size
    needed = -(-num_tokens // ps)
    if len(block_table) < needed or len(generations) != len(block_table):
        return f"block table has {len(block_table)} pages for {num_tokens} tokens"
    pages = block_table[:needed]
    if any(not 0 <= p < allocator.num_pages for p in pages):
        return "block table points outside the pool"
    owners, issued, written = (
        records[pages].tolist()
        for records in (allocator.owner, allocator.generation, allocator.written)
    )
    for i, p in enumerate(pages):
        if owners[i] != (PREFIX_OWNER if i < num_shared else owner):
            return f"page {p} is owned by {owners[i]}, not by this request"
    for i, p in enumerate(pages):
        if issued[i] != generations[i]:
            return f"page {p} was freed and reissued since it was granted (generation changed)"
    lent = allocator.reissued_while_lent(pages)
    if lent.any():
        return f"page {pages[lent.argmax()]} was reissued while still lent to a KV transfer"
    if num_shared:
        problem = check_shared_prefix(allocator, owner, tenant, pages[:num_shared])
        if problem:
            return problem
    for i, p in enumerate(pages):
        required = min(max(num_written - i * ps, 0), ps)
        if written[i] < required:
            return f"page {p} holds {written[i]} written slots, attention would read {required}"
    return None


def check_shared_prefix(
    allocator: PageAllocator, owner: int, tenant: int, shared: list[int]
) -> str | None:
    """The request's leading prefix-cache pages are referenced, were cached by the request's
    own tenant, and are held through references the request took itself."""
    if (allocator.refcount[shared] <= 0).any():
        return "shared prefix page held without a reference"
    for p, cached_by in zip(shared, allocator.tenant[shared].tolist()):
        if cached_by != tenant:
            return f"page {p} was cached by another tenant"  # not which: the client sees this
    if not allocator.holds_shared(owner, shared):
        return "shared prefix pages read without references this request took"
    return None


# Up to this many pages a batch is checked request by request: below it, numpy's fixed cost
# per call makes the vectorized pass slower than the plain loop.
ONE_BY_ONE_PAGES = 128


def check_batch(allocator: PageAllocator, entries: list[TableCheck]) -> list[str | None]:
    """check_block_table for every request of a step, in one vectorized pass over all their
    pages, since checks one by one grow with the batch. Small batches, and any batch where
    something is wrong (to name the problem), are checked one by one."""
    if sum(len(entry.block_table) for entry in entries) <= ONE_BY_ONE_PAGES:
        return [check_block_table(allocator, *entry) for entry in entries]
    ps = allocator.page_size
    pages, generations, owners, tenants, counts, shared, written = (
        [],
        [],
        [],
        [],
        [],
        [],
        [],
    )
    for owner, tenant, table, gens, num_shared, num_written, num_tokens in entries:
        needed = -(-num_tokens // ps)
        if len(table) < needed or len(gens) != len(table):
            return [check_block_table(allocator, *entry) for entry in entries]
        pages += table[:needed]
        generations += gens[:needed]
        owners.append(owner)
        tenants.append(tenant)
        counts.append(needed)
        shared.append(num_shared)
        written.append(num_written)
    pages, counts = (
        np.asarray(pages, dtype=np.int64),
        np.asarray(counts, dtype=np.int64),
    )
    index = np.arange(pages.size) - np.repeat(
        np.cumsum(counts) - counts, counts
    )  # page index in its table
    expected_owner = np.repeat(np.asarray(owners, dtype=np.int64), counts)
    is_shared = index < np.repeat(np.asarray(shared, dtype=np.int64), counts)
    expected_owner[is_shared] = PREFIX_OWNER
    expected_tenant = np.repeat(np.asarray(tenants, dtype=np.int64), counts)
    required = np.clip(np.repeat(np.asarray(written, dtype=np.int64), counts) - index * ps, 0, ps)
    if (
        (pages.size == 0 or pages.min() >= 0 and pages.max() < allocator.num_pages)
        and (allocator.owner[pages] == expected_owner).all()
        and (allocator.refcount[pages[is_shared]] > 0).all()
        and (allocator.tenant[pages[is_shared]] == expected_tenant[is_shared]).all()
        and (allocator.generation[pages] == np.asarray(generations, dtype=np.int64)).all()
        and not allocator.reissued_while_lent(pages).any()
        and (allocator.written[pages] >= required).all()
        and all(
            allocator.holds_shared(e.owner, e.block_table[: e.num_shared])
            for e in entries
            if e.num_shared
        )
    ):
        return [None] * len(entries)
    return [check_block_table(allocator, *entry) for entry in entries]
