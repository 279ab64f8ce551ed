"""Continuous batching with chunked prefill under a per-step token budget, shared fairly
between tenants.

Each step: running decodes first (one token each), then prefill work: the unfinished
prefill chunks of running requests and new requests from the waiting queue, while budget,
sequence slots and pages last. Prefill work goes to the tenant with the least weighted
service so far (the Virtual Token Counter of Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024): each computed token adds 1 / weight to its tenant's counter,
and a tenant that joins the waiting queue starts at least at the lowest counter of the other
tenants with requests in the engine, or, in an empty engine, at the counter of the tenant
whose request departed last, so it cannot bank idle time. Within a tenant, first come first
served; under `fifo`, across tenants too.
A request's first token waits for the step in progress and for the step that admits it, so
under `fair` both are kept short while several tenants are present (with requests in the
engine, or served in the last PRESENT_S seconds): a step's prefill is at most its number of
decodes, or an eighth of the budget when fewer run; and while at least a 32nd of the
budget decode, a newcomer (a request of a tenant with nothing running, and no more served
than those running) is admitted in a step of its own, the decodes waiting that one step,
never two in a row, and its tenant charged as if it had had them.
When a running request needs a page and none is free, a running request not yet in this
step's batch is preempted, the most recently admitted of the tenant most over its share:
its pages are freed and it goes back to the front of the waiting queue.
"""

import heapq
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from kvfence.engine.request import Request, RequestState
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.prefix_cache import PrefixCache, make_room

PRESENT_S = 10.0  # a tenant served this recently counts as present: its next request is near


@dataclass(frozen=True)
class Share:
    """A tenant's weight under fair scheduling, and the most sequences it may run at once."""

    weight: float = 1.0
    max_running: int | None = None


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        release,
        prefix_cache: PrefixCache | None = None,
        fair: bool = True,
        clock=time.monotonic,
    ):
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.release = release  # frees a request's pages (the engine owns the free path)
        self.fair = fair
        self.shares: dict[str, Share] = {}  # tenants not named here have Share()
        self.counters: dict[str, float] = defaultdict(float)  # weighted tokens served, per tenant
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._waiting: Counter[str] = Counter()  # waiting requests, per tenant
        self._active: Counter[str] = Counter()  # requests waiting or running, per tenant
        self._last_departed = 0.0  # counter of the tenant whose request left the engine last
        self.clock = clock
        self._last_seen: dict[str, float] = {}  # when each tenant last joined or left
        self._newcomer_step = False  # the last step was newcomers' alone
        self.short_prefill = max(1, max_num_batched_tokens // 8)  # a step's prefill, contended
        # Fewer decodes add less to a newcomer's step than a step of its own costs them (on a
        # CPU a step's fixed cost is about that of 5 decodes).
        self.newcomer_min_decodes = max(1, max_num_batched_tokens // 32)
        # Admitting a new request leaves this many pages for running ones to grow into.
        self.watermark = max(1, allocator.num_pages // 100)

    def add(self, req: Request) -> None:
        if req.is_terminal:
            raise RuntimeError(
                f"request {req.request_id} is {req.state.value} and cannot be queued"
            )
        if not self._waiting[req.tenant]:  # joining the queue: no credit for the time away
            others = [self.counters[t] for t, n in self._active.items() if n and t != req.tenant]
            floor = min(others) if others else self._last_departed
            self.counters[req.tenant] = max(self.counters[req.tenant], floor)
        self._waiting[req.tenant] += 1
        self._active[req.tenant] += 1
        self._last_seen[req.tenant] = self.clock()
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self._leave_waiting(req)
        else:
            return
        self._active[req.tenant] -= 1
        self._last_departed = self.counters[req.tenant]
        self._last_seen[req.tenant] = self.clock()

    def _contended(self) -> bool:
        """More than one tenant present: some other tenant's next request is likely near."""
        now = self.clock()
        for tenant in [t for t, seen in self._last_seen.items() if now - seen > PRESENT_S]:
            if not self._active[tenant]:
                del self._last_seen[tenant]
        return len(self._last_seen) > 1

    def _leave_waiting(self, req: Request) -> None:
        self.waiting.remove(req)
        self._waiting[req.tenant] -= 1

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """Returns (request, number of tokens to compute) pairs; pages for them are reserved."""
        self._drop_terminal()
        contended = self.fair and self._contended()
        batch: list[tuple[Request, int]] = []
        decodes = [r for r in self.running if r.num_uncomputed_tokens <= 1]
        # Newcomers get a step of their own where the decodes are what would hold theirs; it
        # is charged as the decodes it holds back, so that tiny requests cannot buy it cheaply.
        if (
            contended
            and not self._newcomer_step
            and len(decodes) >= self.newcomer_min_decodes
            and (newcomers := self._newcomers())
        ):
            self.budget = self.short_prefill
            self._prefill_work(newcomers, batch)
            tenants = {r.tenant for r, _ in batch}
            for tenant in tenants:
                weight = self.shares.get(tenant, Share()).weight
                self.counters[tenant] += len(decodes) / len(tenants) / weight
        self._newcomer_step = bool(batch)
        if batch:
            return batch
        self.budget = self.max_num_batched_tokens
        for req in decodes:
            self._run(req, batch)
        if contended:  # the step stays near a decode step's length
            self.budget = min(self.budget, max(len(batch), self.short_prefill))
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        self._prefill_work(prefills + list(self.waiting), batch)
        return batch

    def _newcomers(self) -> list[Request]:
        """Waiting requests of tenants with nothing running, served no more than those running."""
        running = {r.tenant for r in self.running}
        if not running:
            return []
        floor = min(self.counters[t] for t in running)
        return [
            r for r in self.waiting if r.tenant not in running and self.counters[r.tenant] <= floor
        ]

    def _prefill_work(self, candidates: list[Request], batch: list[tuple[Request, int]]) -> None:
        """Running prefill chunks, then admissions, tenant by tenant: the lowest counter first."""
        queues: dict[str, deque[tuple[int, Request]]] = defaultdict(deque)
        for order, req in enumerate(candidates):
            queues[req.tenant].append((order, req))
        running = Counter(r.tenant for r in self.running)
        busy = {t for t in queues if running[t]}

        def key(t: str) -> tuple:  # on a tie, a tenant with nothing running goes first
            return (self._key(t), self.fair and t in busy, queues[t][0][0], t)

        heap = [key(t) for t in queues]
        heapq.heapify(heap)
        admitting = True
        while heap and self.budget > 0:
            _, _, _, tenant = heapq.heappop(heap)
            _, req = queues[tenant].popleft()
            if req.state == RequestState.RUNNING:
                self._run(req, batch)
            else:  # a tenant's running prefills come before its waiting requests
                cap = self.shares.get(tenant, Share()).max_running
                if (
                    not admitting
                    or len(self.running) >= self.max_num_seqs
                    or cap is not None
                    and running[tenant] >= cap
                ):
                    continue  # nothing more of this tenant's can start this step
                if req in self.waiting:
                    admitting = self._admit(req, batch)
                    running[tenant] += admitting
            if queues[tenant]:
                heapq.heappush(heap, key(tenant))

    def _key(self, tenant: str) -> float:
        return self.counters[tenant] if self.fair else 0.0

    def _charge(self, req: Request, n: int) -> None:
        self.counters[req.tenant] += n / self.shares.get(req.tenant, Share()).weight

    def _run(self, req: Request, batch: list[tuple[Request, int]]) -> None:
        """Schedules a running request's next tokens, preempting others for pages if need be."""
        if req not in self.running or self.budget == 0:
            return
        n = min(req.num_uncomputed_tokens, self.budget)
        while not self._reserve(req, n):
            in_batch = {r.owner for r, _ in batch}
            candidates = [
                (self._key(r.tenant), i, r)
                for i, r in enumerate(self.running)
                if r.owner not in in_batch
            ]
            victim = max(candidates, key=lambda c: c[:2])[2] if candidates else None
            self._preempt(victim)
            if victim is req:
                return
        batch.append((req, n))
        self._charge(req, n)
        self.budget -= n

    def _admit(self, req: Request, batch: list[tuple[Request, int]]) -> bool:
        """Starts a waiting request if its first chunk fits; False stops admissions this step."""
        self._attach_cached_prefix(req)
        n = min(req.num_uncomputed_tokens, self.budget)
        needed = self.allocator.pages_for(req.num_computed_tokens + n) - len(req.block_table)
        if needed + self.watermark > self._available() or not self._reserve(req, n):
            return False
        self._leave_waiting(req)
        self.running.append(req)
        req.set_state(RequestState.RUNNING)
        batch.append((req, n))
        self._charge(req, n)
        self.budget -= n
        return True

    def _available(self) -> int:
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return self.allocator.num_free + evictable

    def _attach_cached_prefix(self, req: Request) -> None:
        if self.prefix_cache is None or req.prefix_checked or req.block_table:
            return
        req.prefix_checked = True
        pages = self.prefix_cache.lookup(req.tenant, req.owner, req.all_token_ids)
        self.allocator.attach(req.block_table, req.page_generations, pages)
        req.num_shared_pages = len(pages)
        req.num_computed_tokens = req.num_cached_tokens = len(pages) * self.allocator.page_size

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        needed = self.allocator.pages_for(req.num_computed_tokens + num_tokens) - len(
            req.block_table
        )
        if needed <= 0:
            return True
        if not make_room(self.allocator, self.prefix_cache, needed):
            return False
        self.allocator.grant(req.owner, req.block_table, req.page_generations, needed)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.num_computed_tokens = 0
        req.prefix_checked = False
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.set_state(RequestState.PREEMPTED)
        self._waiting[req.tenant] += 1
        self.waiting.appendleft(req)

    def _drop_terminal(self) -> None:
        """A terminal request never stays queued; its pages go back at once."""
        for req in [r for r in list(self.waiting) + self.running if r.is_terminal]:
            self.remove(req)
            self.release(req)
