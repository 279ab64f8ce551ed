"""Page allocator ownership records and the runtime sentinel."""

import pytest

from kvfence.kv import sentinel
from kvfence.kv.allocator import FREE, OwnershipError, PageAllocator
from kvfence.kv.sentinel import TableCheck, check_batch, check_block_table

ALICE = 0  # the first tenant number an allocator gives (PageAllocator.tenant_number)


def granted(allocator, owner, count, written_tokens):
    pages = allocator.allocate(owner, count)
    gens = [int(allocator.generation[p]) for p in pages]
    for i, p in enumerate(pages):
        allocator.mark_written(
            owner,
            p,
            min(max(written_tokens - i * allocator.page_size, 0), allocator.page_size),
        )
    return pages, gens


def test_allocation_gives_each_page_one_owner():
    a = PageAllocator(8, 4)
    p1 = a.allocate(1, 3)
    p2 = a.allocate(2, 5)
    assert not set(p1) & set(p2)
    assert all(a.owner[p] == 1 for p in p1) and all(a.owner[p] == 2 for p in p2)
    assert a.num_free == 0
    with pytest.raises(OwnershipError):
        a.allocate(3, 1)


def test_free_bumps_generation_and_touches_only_the_owners_pages():
    a = PageAllocator(4, 4)
    pages = a.allocate(1, 2)
    theirs = a.allocate(2, 1)
    before = a.generation[pages].copy()
    assert sorted(a.free_owner(1)) == sorted(pages)
    assert (a.generation[pages] != before).all()
    assert len(set(a.generation.tolist())) == a.num_pages, "generations are unique across pages"
    assert (a.owner[pages] == FREE).all() and (a.written[pages] == 0).all()
    assert a.free_owner(1) == []  # nothing left to free twice
    assert a.owner[theirs[0]] == 2, "another owner's page is untouched"


def test_writes_only_by_the_owner():
    a = PageAllocator(2, 4)
    (p,) = a.allocate(1, 1)
    with pytest.raises(OwnershipError):
        a.mark_written(2, p, 4)


def test_sentinel_accepts_a_sound_block_table():
    a = PageAllocator(8, 4)
    pages, gens = granted(a, 7, 3, 10)
    assert check_block_table(a, 7, ALICE, pages, gens, 0, num_written=10, num_tokens=11) is None


def test_sentinel_catches_a_page_of_another_request():
    a = PageAllocator(8, 4)
    pages, gens = granted(a, 7, 2, 8)
    other, other_gens = granted(a, 8, 1, 4)
    table, table_gens = [pages[0], other[0]], [gens[0], other_gens[0]]
    problem = check_block_table(a, 7, ALICE, table, table_gens, 0, 8, 8)
    assert problem and "owned by 8" in problem


def test_sentinel_catches_a_stale_generation():
    a = PageAllocator(1, 4)
    pages, gens = granted(a, 7, 1, 4)
    a.free_owner(7)
    again, _ = granted(a, 7, 1, 4)  # same page, same owner id, new generation
    assert again == pages
    problem = check_block_table(a, 7, ALICE, pages, gens, 0, 4, 4)
    assert problem and "generation" in problem


def test_sentinel_catches_reading_unwritten_slots():
    """The incident: one token written, attention about to read the whole reserved range."""
    a = PageAllocator(8, 4)
    pages, gens = granted(a, 7, 4, 1)
    problem = check_block_table(a, 7, ALICE, pages, gens, 0, num_written=15, num_tokens=16)
    assert problem and "written" in problem


def test_sentinel_catches_a_short_block_table():
    a = PageAllocator(8, 4)
    pages, gens = granted(a, 7, 1, 4)
    assert "block table" in check_block_table(a, 7, ALICE, pages, gens, 0, 4, 5)


def test_sentinel_catches_pages_outside_the_pool():
    a = PageAllocator(8, 4)
    assert "outside" in check_block_table(a, 7, ALICE, [99], [0], 0, 0, 1)


def test_sentinel_catches_swapped_shared_pages():
    """Two prefix-cache pages look alike by owner; only their generations tell them apart."""
    a = PageAllocator(8, 4)
    mine, my_gens = granted(a, 7, 2, 8)
    theirs, their_gens = granted(a, 8, 2, 8)
    for owner, pages in ((7, mine), (8, theirs)):
        for p in pages:
            a.share(owner, p, "alice")
    assert check_block_table(a, 7, ALICE, mine, my_gens, 2, 8, 9 - 1) is None
    swapped = [theirs[0], mine[1]]
    problem = check_block_table(a, 7, ALICE, swapped, my_gens, 2, 8, 8)
    assert problem and "generation" in problem


@pytest.mark.parametrize("vectorized", [True, False])
def test_sentinel_checks_a_whole_batch_at_once(vectorized, monkeypatch):
    """One vectorized pass (batches of many pages) finds the same problems, on the same
    requests, as the checks one by one (small batches)."""
    monkeypatch.setattr(sentinel, "ONE_BY_ONE_PAGES", 0 if vectorized else 10**9)
    a = PageAllocator(32, 4)
    sound = []
    for owner in (1, 2, 3):
        pages, gens = granted(a, owner, 3, 10)
        sound.append(TableCheck(owner, ALICE, pages, gens, 0, 10, 11))
    assert check_batch(a, sound) == [None, None, None]
    assert check_batch(a, []) == []
    mine, my_gens = granted(a, 7, 2, 8)
    theirs, their_gens = granted(a, 8, 1, 4)
    few, few_gens = granted(a, 9, 4, 1)
    broken = [
        TableCheck(
            7, ALICE, [mine[0], theirs[0]], [my_gens[0], their_gens[0]], 0, 8, 8
        ),  # another's page
        TableCheck(9, ALICE, few, few_gens, 0, 15, 16),  # never written
        TableCheck(7, ALICE, [99], [0], 0, 0, 1),  # outside the pool
        TableCheck(7, ALICE, mine, [my_gens[0], my_gens[1] + 1], 0, 8, 8),  # stale generation
        TableCheck(7, ALICE, mine[:1], my_gens[:1], 0, 4, 5),  # short block table
    ]
    for bad in broken:
        batch = [sound[0], bad, sound[1]]
        problems = check_batch(a, batch)
        assert problems[0] is None and problems[2] is None and problems[1] is not None
        assert problems == [check_block_table(a, *entry) for entry in batch]


def cached_pages(allocator, owner, count, tenant):
    """`count` full pages written by `owner` and handed to `tenant`'s prefix cache."""
    pages, gens = granted(allocator, owner, count, count * allocator.page_size)
    for p in pages:
        allocator.share(owner, p, tenant)
    return pages, gens


@pytest.mark.parametrize("vectorized", [True, False])
def test_sentinel_catches_a_page_another_tenant_cached(vectorized, monkeypatch):
    """What a prefix-cache keying regression does: bob's lookup takes a reference on a page
    alice cached. Its owner (the cache), reference count, generation and slots all look right."""
    monkeypatch.setattr(sentinel, "ONE_BY_ONE_PAGES", 0 if vectorized else 10**9)
    a = PageAllocator(16, 4)
    alices, gens = cached_pages(a, 7, 2, "alice")
    a.acquire_shared(alices[0], 8)
    own, own_gens = granted(a, 8, 1, 0)
    bob = TableCheck(8, a.tenant_number("bob"), [alices[0]] + own, [gens[0]] + own_gens, 1, 4, 5)
    alice = TableCheck(7, ALICE, alices, gens, 2, 7, 8)
    problems = check_batch(a, [alice, bob])
    assert problems[0] is None and "another tenant" in problems[1]
    assert "alice" not in problems[1]  # the client reading the error is not told whose page it was


@pytest.mark.parametrize("vectorized", [True, False])
def test_sentinel_catches_a_shared_page_read_without_its_own_reference(vectorized, monkeypatch):
    """A cached page copied into another request's block table: it is referenced, but by
    the request holding it, not by the copier."""
    monkeypatch.setattr(sentinel, "ONE_BY_ONE_PAGES", 0 if vectorized else 10**9)
    a = PageAllocator(16, 4)
    cached, gens = cached_pages(a, 7, 1, "alice")
    holder = TableCheck(7, ALICE, cached, gens, 1, 3, 4)
    copiers = []
    for owner in (8, 9):
        own, own_gens = granted(a, owner, 1, 0)
        copiers.append(TableCheck(owner, ALICE, cached + own, gens + own_gens, 1, 4, 5))
    problems = check_batch(a, [holder, *copiers])
    assert problems[0] is None and all("without references" in p for p in problems[1:])
    a.acquire_shared(cached[0], 8)  # a lookup for request 8
    problems = check_batch(a, [holder, *copiers])
    assert problems[:2] == [None, None] and "without references" in problems[2]
    assert a.release_references(8) == cached  # LLMEngine.release, by the records
    assert "without references" in check_block_table(a, *copiers[0])
    assert a.refcount[cached[0]] == 1 and check_block_table(a, *holder) is None


@pytest.mark.parametrize("vectorized", [True, False])
def test_sentinel_catches_a_page_reissued_while_lent_to_a_transfer(vectorized, monkeypatch):
    """A parked prefill's pages freed before its reader is done (a lease cut short): whoever
    is given them next is refused until the loan ends, by the reader's release or by time."""
    import time

    monkeypatch.setattr(sentinel, "ONE_BY_ONE_PAGES", 0 if vectorized else 10**9)
    a = PageAllocator(8, 4)
    parked, _ = granted(a, 1, 2, 8)
    a.lend(parked, time.monotonic() + 60)
    a.free_owner(1)  # the fault: freed while lent
    reused, gens = granted(a, 2, 2, 0)
    assert sorted(reused) == sorted(parked), "the stack reissues the freshest pages first"
    other, other_gens = granted(a, 3, 1, 0)
    batch = [
        TableCheck(2, ALICE, reused, gens, 0, 0, 5),
        TableCheck(3, ALICE, other, other_gens, 0, 0, 1),
    ]
    problems = check_batch(a, batch)
    assert "lent to a KV transfer" in problems[0] and problems[1] is None
    a.end_loan(parked)
    assert check_batch(a, batch) == [None, None]
    a.lend(parked, time.monotonic() - 1)  # a loan whose lease is over binds nobody
    assert check_batch(a, batch) == [None, None]


@pytest.mark.parametrize("vectorized", [True, False])
def test_sentinel_serves_a_prefix_hit_on_pages_lent_in_their_own_lifetime(vectorized, monkeypatch):
    """A parked prefill's full pages are in its tenant's prefix cache while a decode worker
    copies them: a same-tenant hit reads the very KV the reader copies, which is no reuse."""
    import time

    monkeypatch.setattr(sentinel, "ONE_BY_ONE_PAGES", 0 if vectorized else 10**9)
    a = PageAllocator(16, 4)
    parked, gens = cached_pages(a, 7, 2, "alice")
    a.lend(parked, time.monotonic() + 60)
    for p in parked:
        a.acquire_shared(p, 8)
    own, own_gens = granted(a, 8, 1, 0)
    hit = TableCheck(8, ALICE, parked + own, gens + own_gens, 2, 8, 9)
    assert check_batch(a, [hit]) == [None]
