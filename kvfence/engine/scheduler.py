"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running requests first (single-token decodes, then unfinished prefill
chunks), then new requests from the waiting queue while budget, sequence slots and pages
last. When a running request needs a page and none is free, the most recently admitted
request not yet in this step's batch is preempted: its pages are freed and it goes back
to the front of the waiting queue to be recomputed from its tokens so far.
"""
from collections import deque

from kvfence.engine.request import Request, RequestState
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.prefix_cache import PrefixCache


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_seqs: int, max_num_batched_tokens: int, release,
                 prefix_cache: PrefixCache | None = None):
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.release = release  # frees a request's pages (the engine owns the free path)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Admitting a new request leaves this many pages for running ones to grow into.
        self.watermark = max(1, allocator.num_pages // 100)

    def add(self, req: Request) -> None:
        if req.is_terminal:
            raise RuntimeError(f"request {req.request_id} is {req.state.value} and cannot be queued")
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """Returns (request, number of tokens to compute) pairs; pages for them are reserved."""
        self._drop_terminal()
        budget = self.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        in_batch: set[int] = set()
        ordered = sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1)  # decodes first
        for req in ordered:
            if req not in self.running or budget == 0:
                continue
            n = min(req.num_uncomputed_tokens, budget)
            while not self._reserve(req, n):
                victim = next((r for r in reversed(self.running) if r.owner not in in_batch), None)
                self._preempt(victim)
                if victim is req:
                    break
            else:
                batch.append((req, n))
                in_batch.add(req.owner)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            self._attach_cached_prefix(req)
            n = min(req.num_uncomputed_tokens, budget)
            needed = self.allocator.pages_for(req.num_computed_tokens + n) - len(req.block_table)
            if needed + self.watermark > self._available() or not self._reserve(req, n):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.set_state(RequestState.RUNNING)
            batch.append((req, n))
            budget -= n
        return batch

    def _available(self) -> int:
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return self.allocator.num_free + evictable

    def _attach_cached_prefix(self, req: Request) -> None:
        if self.prefix_cache is None or req.prefix_checked or req.block_table:
            return
        req.prefix_checked = True
        pages = self.prefix_cache.lookup(req.tenant, req.all_token_ids)
        req.block_table.extend(pages)
        req.page_generations.extend(int(self.allocator.generation[p]) for p in pages)
        req.num_shared_pages = len(pages)
        req.num_computed_tokens = req.num_cached_tokens = len(pages) * self.allocator.page_size

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        needed = self.allocator.pages_for(req.num_computed_tokens + num_tokens) - len(req.block_table)
        if needed <= 0:
            return True
        if needed > self._available():
            return False
        if needed > self.allocator.num_free:
            self.prefix_cache.evict(needed - self.allocator.num_free)
        pages = self.allocator.allocate(req.owner, needed)
        req.block_table.extend(pages)
        req.page_generations.extend(int(self.allocator.generation[p]) for p in pages)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.num_computed_tokens = 0
        req.prefix_checked = False
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.set_state(RequestState.PREEMPTED)
        self.waiting.appendleft(req)

    def _drop_terminal(self) -> None:
        """A terminal request never stays queued; its pages go back at once."""
        for req in [r for r in list(self.waiting) + self.running if r.is_terminal]:
            self.remove(req)
            self.release(req)
