"""Disaggregation's two ends in the engine: prefill-only requests whose pages are parked
for a decode worker to pull, and pages reserved for KV arriving from a prefill worker.

Pages under transfer are never freed while the transport may still touch them: a parked
request's pages stay until its reader is done or its lease ends, a receiving request's until
its read has returned (end_transfer), even if the request was aborted meanwhile. Exported
pages are also lent (allocator.lend) for as long, so that the sentinel refuses any request
given one of them early.
"""

import logging
import time

from kvfence.engine.request import Request, RequestState
from kvfence.engine.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger("kvfence.engine")


class RemoteKV:
    def __init__(self, engine):
        self.engine = engine
        self.parked: dict[str, Request] = {}  # prefilled, pages held for a decode worker
        self.receiving: dict[str, Request] = {}  # pages reserved for KV being read into them
        self.lease_end: dict[str, float] = {}  # when each parked request's pages are freed
        self.loans: dict[str, list[int]] = {}  # exported pages a reader may still copy

    def holds(self, request_id: str) -> bool:
        return request_id in self.parked or request_id in self.receiving

    # --- prefill side ------------------------------------------------------------------

    def add_prefill_only(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
        lease_s: float,
    ) -> Request:
        """Computes the KV of every prompt token but the last, then parks the request with
        its pages for `lease_s` seconds or until the decode worker has pulled them."""
        req = self.engine.admission.prefill_only(prompt_ids, params, request_id, tenant)
        self.engine.scheduler.add(req)
        req.lease_s = lease_s
        self.engine.requests[request_id] = [req]
        return req

    def park(self, req: Request) -> None:
        """The engine computed a prefill-only request's KV: its lease starts now."""
        self.engine.scheduler.remove(req)
        self.lease_end[req.parent_id] = time.monotonic() + req.lease_s
        self.parked[req.parent_id] = req

    def export(self, request_id: str, pages: list[int], until: float) -> None:
        """A manifest of a parked request's pages goes out: a reader may copy them until
        `until` (its lease, time.monotonic) or until release_parked."""
        if request_id not in self.parked:  # its lease already ended: nothing left to lend
            return
        self.loans[request_id] = pages
        self.engine.allocator.lend(pages, until)

    def release_parked(self, request_id: str) -> None:
        """The parked KV was pulled, or its lease ended: end its loan and free its pages."""
        self.engine.allocator.end_loan(self.loans.pop(request_id, []))
        self.free_parked(request_id)

    def free_parked(self, request_id: str) -> None:
        req = self.parked.pop(request_id, None)
        self.lease_end.pop(request_id, None)
        if req is not None and not req.is_terminal:
            self.engine.finish(req, RequestState.FINISHED_STOP)
            self.engine.requests.pop(request_id, None)

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

    def reserve(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
        kv_tokens: int,
    ) -> Request:
        """Admits a request whose first `kv_tokens` prompt tokens arrive as KV from a prefill
        worker, and reserves pages for them. It is not scheduled until end_transfer."""
        engine = self.engine
        req = engine.admission.remote(prompt_ids, params, request_id, tenant)
        allocator = engine.allocator
        needed = allocator.pages_for(kv_tokens)
        if engine.prefix_cache and needed > allocator.num_free:
            engine.prefix_cache.evict(needed - allocator.num_free)
        if needed > allocator.num_free:
            raise InvalidRequest(
                f"the decode pool has {allocator.num_free} free pages, {needed} are needed; "
                "retry shortly",
                "prompt",
                "kv_pool_busy",
            )
        allocator.grant(req.owner, req.block_table, req.page_generations, needed)
        engine.requests[request_id] = [req]
        self.receiving[request_id] = req
        return req

    def end_transfer(self, request_id: str, received_tokens: int | None) -> None:
        """The read into a receiving request's pages has returned: nothing writes them any
        more. With the KV of `received_tokens` tokens (None: the transfer failed) the request
        decodes after exactly those; aborted or failed meanwhile, its pages are freed."""
        engine = self.engine
        req = self.receiving.pop(request_id)
        if req.is_terminal:
            engine.release(req)
        elif received_tokens is None:
            engine.finish(req, RequestState.FAILED, "the KV transfer failed")
            engine.requests.pop(request_id, None)
        else:
            self.resume_after(req, received_tokens, received_tokens)

    def resume_after(self, req: Request, written: int, computed: int) -> None:
        """Queues a received request to decode after `computed` prompt tokens, of which the
        first `written` hold its KV."""
        self.engine.runner.mark_written(req, 0, written)
        req.num_computed_tokens = computed
        req.num_prompt_tokens_computed = 0
        self.engine.scheduler.add(req)
