"""TEST ONLY: faults injected on purpose. `legacy-reject-path` re-creates the 2026 KV leak;
`truncated-transfer` makes a prefill worker ship less KV than its manifest promises.

The legacy engine turned a prompt larger than the KV pool into a one-token placeholder,
marked it rejected, and then let it through because its admission queue asked "is it
finished?" instead of "is it terminal?". The placeholder kept the pages reserved for the
whole prompt and decoding read them as if they held this prompt's KV; they held stale KV
of earlier requests. Nothing here runs unless the fault is injected; it exists so tests
can show the sentinel stops it and `kvfence audit` detects it when the sentinel is off.
"""
import logging

from kvfence.engine.request import Request, RequestState
from kvfence.engine.sampling_params import SamplingParams

LEGACY_REJECT_PATH = "legacy-reject-path"
TRUNCATED_TRANSFER = "truncated-transfer"
LEGACY_FINISHED = {RequestState.FINISHED_STOP, RequestState.FINISHED_LENGTH}
BANNER = ("!!! FAULT INJECTED: legacy-reject-path. Oversized prompts become one-token placeholders that decode "
          "over stale KV pages of other requests. NEVER run this outside tests. !!!")

log = logging.getLogger("kvfence.fault")


def warn_at_start() -> None:
    log.warning(BANNER)
    log.warning("!!! FAULT INJECTED: the KV pool may be smaller than max_model_len; the start-up check is skipped !!!")


def oversized(engine, prompt_ids: list[int], params: SamplingParams) -> bool:
    """Fits the advertised context but not the pool: the case the legacy path mishandled."""
    return (engine.config.inject_fault == LEGACY_REJECT_PATH
            and len(prompt_ids) < engine.max_model_len
            and engine.allocator.pages_for(len(prompt_ids) + 1) > engine.allocator.num_pages)


def admit_placeholder(engine, prompt_ids: list[int], params: SamplingParams, request_id: str, tenant: str) -> Request:
    allocator, ps = engine.allocator, engine.allocator.page_size
    if engine.prefix_cache:  # the legacy engine took every page it could get
        engine.prefix_cache.evict(engine.prefix_cache.num_evictable)
    max_tokens = min(params.max_tokens or 16, 64)
    claimed = max(2, allocator.num_free * ps - max_tokens)  # what the reserved pages can pretend to hold
    req = Request(request_id=f"{request_id}-0", prompt_token_ids=prompt_ids[-claimed:], parent_id=request_id, index=0,
                  params=params, max_tokens=max_tokens, tenant=tenant)
    log.warning("!!! FAULT legacy-reject-path: request %s (%d prompt tokens, pool %d tokens) replaced by a one-token "
                "placeholder that decodes over %d stale reserved positions", request_id, len(prompt_ids),
                allocator.num_pages * ps, claimed - 1)
    req.state = RequestState.REJECTED          # the legacy scheduler marked it rejected...
    if req.state not in LEGACY_FINISHED:       # ...but its admission queue asked "finished?"
        pages = allocator.allocate(req.owner, allocator.pages_for(claimed + max_tokens))
        req.block_table.extend(pages)
        req.page_generations.extend(int(allocator.generation[p]) for p in pages)
        req.num_computed_tokens = claimed - 1  # only the last token is computed: the placeholder
        req.prefix_checked = True
        req.state = RequestState.WAITING
        engine.scheduler.waiting.append(req)
    return req


def admit_prefill_placeholder(engine, prompt_ids: list[int], params: SamplingParams, request_id: str,
                              tenant: str) -> Request:
    """Prefill side of the P/D replay: one placeholder token of KV is computed and shipped."""
    log.warning("!!! FAULT legacy-reject-path: request %s (%d prompt tokens, prefill pool %d tokens) replaced by a "
                "one-token placeholder; one token of KV will be transferred", request_id, len(prompt_ids),
                engine.allocator.num_pages * engine.allocator.page_size)
    req = Request(request_id=f"{request_id}-0", prompt_token_ids=prompt_ids[-2:-1], parent_id=request_id, index=0,
                  params=params, max_tokens=0, tenant=tenant, prefill_only=True)
    req.state = RequestState.REJECTED          # marked rejected...
    if req.state not in LEGACY_FINISHED:       # ...admitted because the queue asked "finished?"
        req.state = RequestState.WAITING
        engine.scheduler.waiting.append(req)
    return req


def decode_trusts_reservation(engine) -> bool:
    """Decode side of the P/D replay: the legacy decoder skipped the manifest check and
    decoded over every page it had reserved, whatever had arrived."""
    if engine.config.inject_fault != LEGACY_REJECT_PATH:
        return False
    log.warning("!!! FAULT legacy-reject-path: decoding over the whole reservation without checking the manifest")
    return True


def trust_reservation(engine, request_id: str, received: int | None, claimed: int) -> None:
    """Decode side of the P/D replay: decoding resumes after `claimed` tokens, whatever the
    transfer brought."""
    engine.end_transfer(request_id, received)
    if received is not None:
        engine.requests[request_id][0].num_computed_tokens = claimed


def truncate(manifest, transfer) -> None:
    """TEST ONLY (`--inject-fault truncated-transfer`): the last page of every layer is not
    shipped; the region offered in its place is the scratch page, while the manifest keeps
    the checksum of the real data."""
    log.warning("!!! FAULT truncated-transfer: transfer %s ships without its last page", manifest.transfer_id)
    pool, n = transfer.pool, manifest.page_count
    for i in range(n - 1, len(manifest.descs), n):
        tensor = pool.k if i < len(manifest.descs) // 2 else pool.v
        manifest.descs[i][0] = transfer.address(tensor, (i // n) % manifest.num_layers, pool.scratch_slot)
