"""TEST ONLY: known KV leaks re-created on purpose, each replacing live parts of an engine
(or a worker's KV transfer) when a server is assembled.

`legacy-reject-path` re-creates the 2026 KV leak. The legacy engine turned a prompt larger
than the KV pool into a one-token placeholder, marked it rejected, and then let it through
because its admission queue asked "is it finished?" instead of "is it terminal?". The
placeholder kept the pages reserved for the whole prompt and decoding read them as if they
held this prompt's KV; they held stale KV of earlier requests. In disaggregated mode the
prefill side shipped one token of KV and the decode side decoded over its whole reservation.

`truncated-transfer` makes a prefill worker ship less KV than its manifest promises.

`shared-prefix-cache` keys the prefix cache without the tenant, as vLLM did before
`cache_salt` (CVE-2025-46570) and SGLang's HiCache L3 tier did (sglang #26747): one tenant's
prompt then serves, and times, another's. The pages still record who cached them.

`stale-lease` frees a parked prefill's pages as its manifest goes out, while the manifest
promises the reader its whole lease, and the decode side skips the checksums: the read copies
whatever the pages hold by then (vLLM's NIXL connector after a lease expiry served 8 of 42
requests from freed blocks with HTTP 200, aws-do-eks #84).

`stale-block-reuse` lets a finished reader of prefix-cache pages drop every reference to
them, so they are evicted and reissued while other requests still hold them in their block
tables (vLLM #52234 answered "the previous prompt's answer" with HTTP 200; SGLang #34208).

`unwritten-prefix-read` hands a prompt's pages to the prefix cache when they are reserved,
not when written, as vLLM v0's block manager marked a prompt's blocks computed once its
prefill was scheduled (#7822): a prefill reserves its whole prompt at once, and one that
stops early (aborted, preempted) leaves cached pages it never wrote, which the next prompt
with that prefix reads as its own, whatever KV they last held.

Nothing here is imported unless a fault is injected, which the configuration allows only
with KVFENCE_ALLOW_FAULTS=1; it exists so tests can show that the sentinel stops each fault and
that `kvfence audit` detects it when the sentinel is off.
"""

import logging
import time
from dataclasses import dataclass

from kvfence.config import check_fault_allowed
from kvfence.engine.admission import Admission
from kvfence.engine.llm_engine import EngineParts
from kvfence.engine.remote_kv import RemoteKV
from kvfence.engine.request import Request, RequestState
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.scheduler import Scheduler
from kvfence.kv.allocator import PREFIX_OWNER
from kvfence.kv.prefix_cache import PrefixCache

LATE_READ_S = 1.0  # stale-lease: how late each read starts
LEGACY_FINISHED = {RequestState.FINISHED_STOP, RequestState.FINISHED_LENGTH}

log = logging.getLogger("kvfence.fault")


@dataclass(frozen=True)
class Fault:
    """What one fault swaps in: engine parts, and a mixin put before the worker's KV transfer
    class (disagg/transfer.py's KVTransfer)."""

    parts: EngineParts = EngineParts()
    transfer: type | None = None
    warnings: tuple[str, ...] = ()

    def transfer_class(self, base: type) -> type:
        if self.transfer is None:
            return base
        return type(self.transfer.__name__, (self.transfer, base), {})


def inject(name: str) -> Fault:
    """The fault `name`, once the environment allows faults; says so loudly."""
    check_fault_allowed(name)
    fault = FAULTS[name]
    for line in fault.warnings or (f"{name}. NEVER run this outside tests.",):
        log.warning("!!! FAULT INJECTED: %s !!!", line)
    return fault


class LegacyAdmission(Admission):
    @classmethod
    def of(cls, engine) -> "LegacyAdmission":
        admission = super().of(engine)
        admission.prefix_cache = engine.prefix_cache  # the legacy engine evicted it all
        return admission

    def oversized(self, prompt_ids: list[int]) -> bool:
        """Fits the advertised context but not the pool: the case the legacy path mishandled."""
        allocator = self.allocator
        return (
            len(prompt_ids) < self.max_model_len
            and allocator.pages_for(len(prompt_ids) + 1) > allocator.num_pages
        )

    def check(self, prompt_ids, params, kv_tokens=None) -> int:
        if self.oversized(prompt_ids):
            return 1  # let through, to become a placeholder
        return super().check(prompt_ids, params, kv_tokens)

    def requests(self, prompt_ids, params, request_id, tenant) -> list[Request]:
        if not self.oversized(prompt_ids):
            return super().requests(prompt_ids, params, request_id, tenant)
        allocator, ps = self.allocator, self.allocator.page_size
        if self.prefix_cache:  # the legacy engine took every page it could get
            self.prefix_cache.evict(self.prefix_cache.num_evictable)
        max_tokens = min(params.max_tokens or 16, 64)
        claimed = max(2, allocator.num_free * ps - max_tokens)  # what the pages can pretend to hold
        req = self.sequence(prompt_ids[-claimed:], params, request_id, tenant, max_tokens)
        log.warning(
            "!!! FAULT legacy-reject-path: request %s (%d prompt tokens, pool %d tokens) "
            "replaced by a one-token placeholder that decodes over %d stale reserved positions",
            request_id,
            len(prompt_ids),
            allocator.num_pages * ps,
            claimed - 1,
        )
        req.state = RequestState.REJECTED  # the legacy scheduler marked it rejected...
        if req.state not in LEGACY_FINISHED:  # ...but its admission queue asked "finished?"
            allocator.grant(
                req.owner,
                req.block_table,
                req.page_generations,
                allocator.pages_for(claimed + max_tokens),
            )
            req.num_computed_tokens = claimed - 1  # only the last token is computed
            req.prefix_checked = True
            req.state = RequestState.WAITING
        return [req]

    def prefill_only(self, prompt_ids, params: SamplingParams, request_id, tenant) -> Request:
        """Prefill side of the P/D replay: one placeholder token of KV is computed and shipped."""
        if not self.oversized(prompt_ids):
            return super().prefill_only(prompt_ids, params, request_id, tenant)
        allocator = self.allocator
        log.warning(
            "!!! FAULT legacy-reject-path: request %s (%d prompt tokens, prefill pool %d tokens) "
            "replaced by a one-token placeholder; one token of KV will be transferred",
            request_id,
            len(prompt_ids),
            allocator.num_pages * allocator.page_size,
        )
        req = super().prefill_only(prompt_ids[-2:], params, request_id, tenant)  # one token
        req.state = RequestState.REJECTED  # marked rejected...
        if req.state not in LEGACY_FINISHED:  # ...admitted because the queue asked "finished?"
            req.state = RequestState.WAITING
        return req


class LegacyRemoteKV(RemoteKV):
    """Decode side of the P/D replay: decoding resumes after the whole reservation, whatever
    the transfer brought."""

    def __init__(self, *args):
        super().__init__(*args)
        self.claimed: dict[str, int] = {}

    def receive(self, req: Request, kv_tokens: int) -> None:
        super().receive(req, kv_tokens)
        self.claimed[req.parent_id] = kv_tokens

    def received(self, request_id: str, received_tokens: int | None) -> tuple[Request, int]:
        claimed = self.claimed.pop(request_id, 0)
        req, computed = super().received(request_id, received_tokens)
        if received_tokens is None or req.is_terminal:
            return req, computed
        log.warning("!!! FAULT legacy-reject-path: decoding over the whole reservation")
        return req, claimed


class UncheckedTransfer:
    """Decode side of the P/D replay and of stale-lease: the decoder checks neither the
    manifest nor the pages' checksums."""

    def verify(self, manifest, expected_tokens: int, sums=None) -> None:
        log.warning("!!! FAULT: transfer %s not checked", manifest.transfer_id)


class TruncatedTransfer:
    """The last page of every layer is not shipped; the region offered in its place is the
    scratch page, while the manifest keeps the checksum of the real data."""

    def manifest(self, *args, **kwargs):
        manifest = super().manifest(*args, **kwargs)
        log.warning(
            "!!! FAULT truncated-transfer: transfer %s ships without its last page",
            manifest.transfer_id,
        )
        pool, n = self.pool, manifest.page_count
        for i in range(n - 1, len(manifest.descs), n):
            tensor = pool.k if i < len(manifest.descs) // 2 else pool.v
            layer = (i // n) % manifest.num_layers
            manifest.descs[i][0] = self.address(tensor, layer, pool.scratch_slot)
        return manifest


class TenantBlindPrefixCache(PrefixCache):
    """Pages found by their tokens alone: every tenant hits every other tenant's prefixes."""

    def chain_keys(self, tenant: str, token_ids: list[int], num_pages: int) -> list[bytes]:
        return super().chain_keys("", token_ids, num_pages)


class LateReader(UncheckedTransfer):
    """Decode side of stale-lease: each read starts late, as under load, within the lease the
    manifest promised."""

    def read(self, manifest, pages: list[int], deadline: float) -> None:
        time.sleep(LATE_READ_S)
        super().read(manifest, pages, deadline)


class EarlyFreeRemoteKV(RemoteKV):
    """The parked pages are freed as the manifest goes out, as if the lease had ended; the
    loan (what the sentinel checks) still runs to the lease's end or the reader's release."""

    def export(self, request_id: str, pages: list[int], until: float) -> None:
        super().export(request_id, pages, until)
        log.warning(
            "!!! FAULT stale-lease: request %s's pages freed before its reader pulled them",
            request_id,
        )
        self.free_parked(request_id)


class ReferenceDroppingPrefixCache(PrefixCache):
    """The first reader to finish drops every reader's reference to the pages it read."""

    def release(self, owner: int) -> None:
        for page in self.allocator.references.pop(owner, []):
            if self.allocator.owner[page] == PREFIX_OWNER:  # not yet reissued
                self.allocator.refcount[page] = 0
                self.lru[page] = None


class PublishOnReserveScheduler(Scheduler):
    """A prefill reserves the rest of its prompt when scheduled and hands its full pages to
    the prefix cache (PublishingPrefixCache) then, before computing them."""

    def schedule(self) -> list[tuple[Request, int]]:
        if self.prefix_cache:
            self.prefix_cache.record_last_step()
        return super().schedule()

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        rest = len(req.prompt_token_ids) - req.num_computed_tokens
        whole = self.prefix_cache and rest > num_tokens and super()._reserve(req, rest)
        if not whole and not super()._reserve(req, num_tokens):
            return False
        if self.prefix_cache and rest > 0:
            self.prefix_cache.publish(req)
            self.prefix_cache.take_chunk(req, num_tokens)
        return True


class PublishingPrefixCache(PrefixCache):
    """Takes pages when they are reserved. The writer holds a reference on each from then on,
    but reads it as a shared page only from the chunk that writes it. The runner records no
    writes to cached pages, so the writes of each step's chunks are recorded here at the
    start of the next step, except a failed request's: the allocator's records say only what
    was written. (A request reading such a page in the step that writes it is refused by
    the sentinel, though the KV would be there: a fault may fail closed.)"""

    def __init__(self, allocator, on_evict):
        super().__init__(allocator, on_evict)
        # Published pages each writer's chunks have not reached yet.
        self.ahead: dict[int, list[int]] = {}
        # Writes to cached pages scheduled last step: (request, page, its generation, slots).
        self.chunks: list[tuple[Request, int, int, int]] = []

    def publish(self, req: Request) -> None:
        """allocator.share and insert, without their check that the page was written."""
        allocator, ps = self.allocator, self.allocator.page_size
        ahead = self.ahead.setdefault(req.owner, [])
        start = req.num_shared_pages + len(ahead)
        full = min(len(req.prompt_token_ids) // ps, len(req.block_table))
        keys = self.chain_keys(req.tenant, req.prompt_token_ids, full)
        for i in range(start, full):
            page = req.block_table[i]
            if keys[i] in self.pages or allocator.owner[page] != req.owner:
                break
            allocator.owner[page] = PREFIX_OWNER
            allocator.refcount[page] = 1
            allocator.tenant[page] = allocator.tenant_number(req.tenant)
            self.pages[keys[i]], self.keys[page] = page, keys[i]
            ahead.append(page)
        if req.num_shared_pages + len(ahead) > start:
            log.warning(
                "!!! FAULT unwritten-prefix-read: request %s's pages %d-%d cached unwritten",
                req.request_id,
                start,
                req.num_shared_pages + len(ahead) - 1,
            )

    def take_chunk(self, req: Request, num_tokens: int) -> None:
        """The chunk reads the published pages it reaches as shared ones from now on."""
        ps, start = self.allocator.page_size, req.num_computed_tokens
        end = start + num_tokens
        ahead = self.ahead.get(req.owner, [])
        for i in range(start // ps, -(-end // ps)):
            if i == req.num_shared_pages and ahead:
                self.allocator.references.setdefault(req.owner, []).append(ahead.pop(0))
                req.num_shared_pages += 1
            if i < req.num_shared_pages:
                page = req.block_table[i]
                generation = int(self.allocator.generation[page])
                self.chunks.append((req, page, generation, min(end - i * ps, ps)))

    def record_last_step(self) -> None:
        """Records the writes of last step's chunks to cached pages still in that lifetime."""
        allocator = self.allocator
        for req, page, generation, upto in self.chunks:
            if req.state != RequestState.FAILED and allocator.generation[page] == generation:
                allocator.mark_written(PREFIX_OWNER, page, upto)
        self.chunks.clear()

    def release(self, owner: int) -> None:
        for page in self.ahead.pop(owner, []):
            self.allocator.refcount[page] -= 1
            if self.allocator.refcount[page] == 0:
                self.lru[page] = None
        super().release(owner)


FAULTS: dict[str, Fault] = {
    "legacy-reject-path": Fault(
        EngineParts(admission=LegacyAdmission, remote_kv=LegacyRemoteKV),
        UncheckedTransfer,
        (
            "legacy-reject-path. Oversized prompts become one-token placeholders that decode "
            "over stale KV pages of other requests. NEVER run this outside tests.",
            "the KV pool may be smaller than max_model_len; the start-up check is skipped",
        ),
    ),
    "truncated-transfer": Fault(transfer=TruncatedTransfer),
    "shared-prefix-cache": Fault(EngineParts(prefix_cache=TenantBlindPrefixCache)),
    "stale-lease": Fault(EngineParts(remote_kv=EarlyFreeRemoteKV), LateReader),
    "stale-block-reuse": Fault(EngineParts(prefix_cache=ReferenceDroppingPrefixCache)),
    "unwritten-prefix-read": Fault(
        EngineParts(prefix_cache=PublishingPrefixCache, scheduler=PublishOnReserveScheduler)
    ),
}
