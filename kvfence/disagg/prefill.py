"""Prefill worker: computes a prompt's KV, parks it, and lets one decode worker pull it.

POST /internal/prefill/v1/{completions,chat/completions} takes the client's body as is,
so admission is exactly unified mode's: a request refused here ends here, and no decode
worker ever hears of it. Only a live, parked request gets a manifest, and only a caller
holding the cluster token (disagg/__init__.py) gets to read it: it names the pool's addresses.
Parked pages are held under a lease: freed when the reader is done, or when the lease ends,
which the manifest tells the reader so that it never reads past it.
"""

import asyncio
import time

from fastapi import FastAPI, Request

from kvfence.disagg.transfer import KVTransfer
from kvfence.server.api import add_completion_routes, prepare
from kvfence.server.errors import REFUSALS, APIError, api_error, api_errors, raise_if_failed

PARK_TIMEOUT_S = 60.0


def single_prompt(p) -> list[int]:
    if len(p.prompts) != 1 or p.params.n != 1:
        raise APIError(
            400,
            "disaggregated serving takes one prompt with n=1 per request",
            param="n",
        )
    return p.prompts[0]


def add_routes(app: FastAPI, park_timeout: float = PARK_TIMEOUT_S) -> None:
    manifests: dict[str, tuple[float, dict]] = {}  # transfer id -> (deadline, manifest and tenant)

    def pulled(transfer_id: str) -> None:
        """The decode worker's read is done (its notification arrived): free the pages now."""
        manifests.pop(transfer_id, None)  # atomic; this runs on the transport's polling thread
        app.state.server.async_engine.post(lambda e: e.remote.release_parked(transfer_id))

    async def prefill(request: Request, chat: bool):
        s = request.app.state.server
        transfer: KVTransfer = request.app.state.transfer
        p = await prepare(s, request, chat)
        prompt = single_prompt(p)
        with api_errors():  # what the router charges the tenant: validated here
            max_tokens = await s.async_engine.call(
                lambda e: e.validate(prompt, p.params, kv_tokens=len(prompt))
            )
        if len(prompt) == 1:  # nothing to prefill: the decode worker computes the only token
            return {"transfer_id": "", "prompt_tokens": 1, "kv_tokens": 0, "max_tokens": max_tokens}
        handle = s.start_stream()
        rid = handle.ids[0]
        try:
            req = await s.async_engine.call(
                lambda e: e.add_prefill_only(prompt, p.params, rid, p.tenant, park_timeout)
            )
            while True:
                _, out = await handle.next(timeout=park_timeout)
                raise_if_failed(out)
                if out.parked:
                    break
        except REFUSALS as e:
            handle.close()
            raise api_error(e) from None
        except BaseException:
            handle.close()
            raise
        handle.detach()
        transfer.on_pulled = pulled
        manifest = await asyncio.to_thread(
            transfer.manifest, rid, list(req.block_table), req.num_tokens
        )
        now = time.monotonic()
        for tid, (deadline, _) in list(manifests.items()):
            if deadline < now:
                manifests.pop(tid, None)
        lease_end = s.engine.remote.lease_end.get(rid, time.monotonic())  # gone: it ended
        pages = list(req.block_table[: manifest.page_count])
        await s.async_engine.call(lambda e: e.remote.export(rid, pages, lease_end))
        manifests[rid] = (lease_end, {"tenant": p.tenant, **manifest.to_dict()})
        transfer.expect(rid, lease_end)
        return {
            "transfer_id": rid,
            "prompt_tokens": len(prompt),
            "kv_tokens": manifest.token_count,
            "max_tokens": max_tokens,
        }

    add_completion_routes(app, "/internal/prefill", prefill)

    @app.get("/internal/transfer/{transfer_id}")
    async def get_manifest(transfer_id: str, request: Request):
        tenant = request.app.state.server.tenant(request)
        entry = manifests.get(transfer_id)
        if entry is None or entry[1]["tenant"] != tenant:
            raise APIError(404, f"no parked transfer {transfer_id}", code="transfer_not_found")
        lease_end, manifest = entry
        return {
            **{k: v for k, v in manifest.items() if k != "tenant"},
            "lease_s": lease_end - time.monotonic(),
        }

    @app.post("/internal/release/{transfer_id}")
    async def release(transfer_id: str, request: Request):
        s = request.app.state.server
        tenant = s.tenant(request)
        entry = manifests.get(transfer_id)
        if entry is None or entry[1]["tenant"] != tenant:
            raise APIError(404, f"no parked transfer {transfer_id}", code="transfer_not_found")
        manifests.pop(transfer_id, None)
        await s.async_engine.call(lambda e: e.remote.release_parked(transfer_id))
        return {"released": transfer_id}
