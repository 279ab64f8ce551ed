"""Disaggregation's two ends in the engine's pages: prefill-only requests whose pages are
parked for a decode worker to pull, and pages reserved for KV arriving from a prefill worker.

Pages under transfer are never freed while the transport may still touch them: a parked
request's pages stay until its reader is done or its lease ends, a receiving request's until
its read has returned (LLMEngine.end_transfer), even if the request was aborted meanwhile.
Exported pages are also lent (allocator.lend) for as long, so that the sentinel refuses any
request given one of them early.
"""

import logging
import time
from collections.abc import Callable

from kvfence.engine.request import Request
from kvfence.engine.sampling_params import InvalidRequest
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.prefix_cache import PrefixCache, make_room

log = logging.getLogger("kvfence.engine")


class RemoteKV:
    def __init__(
        self,
        allocator: PageAllocator,
        prefix_cache: PrefixCache | None,
        end_parked: Callable[[Request], None],
    ):
        self.allocator = allocator
        self.prefix_cache = prefix_cache  # its unreferenced pages make room for a reservation
        self.end_parked = end_parked  # the engine finishes a parked request and frees its pages
        self.parked: dict[str, Request] = {}  # prefilled, pages held for a decode worker
        self.receiving: dict[str, Request] = {}  # pages reserved for KV being read into them
        self.lease_end: dict[str, float] = {}  # when each parked request's pages are freed
        self.loans: dict[str, list[int]] = {}  # exported pages a reader may still copy

    def holds(self, request_id: str) -> bool:
        return request_id in self.parked or request_id in self.receiving

    # --- prefill side ------------------------------------------------------------------

    def park(self, req: Request) -> None:
        """The engine computed a prefill-only request's KV: its lease starts now."""
        self.lease_end[req.parent_id] = time.monotonic() + req.lease_s
        self.parked[req.parent_id] = req

    def export(self, request_id: str, pages: list[int], until: float) -> None:
        """A manifest of a parked request's pages goes out: a reader may copy them until
        `until` (its lease, time.monotonic) or until release_parked."""
        if request_id not in self.parked:  # its lease already ended: nothing left to lend
            return
        self.loans[request_id] = pages
        self.allocator.lend(pages, until)

    def release_parked(self, request_id: str) -> None:
        """The parked KV was pulled, or its lease ended: end its loan and free its pages."""
        self.allocator.end_loan(self.loans.pop(request_id, []))
        self.free_parked(request_id)

    def free_parked(self, request_id: str) -> None:
        req = self.parked.pop(request_id, None)
        self.lease_end.pop(request_id, None)
        if req is not None:
            self.end_parked(req)

    def expire_parked(self) -> None:
        now = time.monotonic()
        for rid, end in list(self.lease_end.items()):
            if end < now:
                log.warning(
                    "request %s: no decode worker pulled its KV in time; freeing it",
                    rid,
                )
                self.release_parked(rid)

    # --- decode side -------------------------------------------------------------------

    def receive(self, req: Request, kv_tokens: int) -> None:
        """Reserves pages for the KV of the first `kv_tokens` prompt tokens of an admitted
        request; raises InvalidRequest where the pool has not that many to spare now."""
        allocator = self.allocator
        needed = allocator.pages_for(kv_tokens)
        if not make_room(allocator, self.prefix_cache, needed):
            raise InvalidRequest(
                f"the decode pool has {allocator.num_free} free pages, {needed} are needed; "
                "retry shortly",
                "prompt",
                "kv_pool_busy",
            )
        allocator.grant(req.owner, req.block_table, req.page_generations, needed)
        self.receiving[req.parent_id] = req

    def received(self, request_id: str, received_tokens: int | None) -> tuple[Request, int]:
        """The receiving request whose read has returned, and the prompt tokens it decodes
        after: the `received_tokens` that hold its KV."""
        return self.receiving.pop(request_id), received_tokens or 0
