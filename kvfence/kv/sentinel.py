"""Runtime check of the ownership invariant, run before every forward step.

For each request in the batch: every page of its block table is owned by it (or is a
prefix-cache page it holds a reference to), still carries the generation it had when it
was granted, and every position attention will read was written for this request.
"""
import numpy as np

from kvfence.kv.allocator import PREFIX_OWNER, PageAllocator


def check_block_table(allocator: PageAllocator, owner: int, block_table: list[int], generations: list[int],
                      num_shared: int, num_written: int, num_tokens: int) -> str | None:
    """Returns None when the request may write and read positions [0, num_tokens), of which
    [0, num_written) must already hold its KV; else says what is wrong.

    The first `num_shared` pages are prefix-cache pages the request holds references to.
    """
    ps = allocator.page_size
    needed = -(-num_tokens // ps)
    if len(block_table) < needed or len(generations) != len(block_table):
        return f"block table has {len(block_table)} pages for {num_tokens} tokens"
    pages = np.asarray(block_table[:needed], dtype=np.int64)
    if pages.size == 0:
        return None
    if pages.min() < 0 or pages.max() >= allocator.num_pages:
        return "block table points outside the pool"
    expected_owner = np.full(needed, owner, dtype=np.int64)
    expected_owner[:num_shared] = PREFIX_OWNER
    bad = np.nonzero(allocator.owner[pages] != expected_owner)[0]
    if bad.size:
        p = int(pages[bad[0]])
        return f"page {p} is owned by {int(allocator.owner[p])}, not by this request"
    if num_shared and (allocator.refcount[pages[:num_shared]] <= 0).any():
        return "shared prefix page held without a reference"
    bad = np.nonzero(allocator.generation[pages] != np.asarray(generations[:needed], dtype=np.int64))[0]
    if bad.size:
        return f"page {int(pages[bad[0]])} was freed and reissued since it was granted (generation changed)"
    required = np.clip(num_written - np.arange(needed) * ps, 0, ps)
    bad = np.nonzero(allocator.written[pages] < required)[0]
    if bad.size:
        p = int(pages[bad[0]])
        return f"page {p} holds {int(allocator.written[p])} written slots, attention would read {int(required[bad[0]])}"
    return None
