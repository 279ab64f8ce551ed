"""Decode worker: pulls a prompt's KV from a prefill worker, checks it, and generates.

POST /internal/decode/v1/{completions,chat/completions} takes the client's body plus two
headers from the router naming the prefill worker and the transfer. The worker admits
the request against its own pool, reserves pages, reads the KV over NIXL, checks the
manifest and every page's checksum, and only then lets the request decode. Any mismatch,
timeout or dead peer fails the request with an error (never 200 with text) and frees the
reserved pages.
"""
import asyncio
import logging

import httpx
from fastapi import FastAPI, Request

from kvfence import faults
from kvfence.disagg.prefill import single_prompt
from kvfence.disagg.transfer import KVTransfer, TransferError, manifest_from_dict, verify
from kvfence.engine.sampling_params import InvalidRequest
from kvfence.server.api import APIError, prepare, respond

PREFILL_URL_HEADER = "x-kvfence-prefill-url"
TRANSFER_ID_HEADER = "x-kvfence-transfer-id"
log = logging.getLogger("kvfence.decode")


def transfer_failed(message: str) -> APIError:
    return APIError(502, f"KV transfer from the prefill worker failed: {message}", type="internal_error",
                    code="kv_transfer_failed")


async def fetch_manifest(client: httpx.AsyncClient, prefill_url: str, transfer_id: str, auth: dict):
    try:
        r = await client.get(f"{prefill_url}/internal/transfer/{transfer_id}", headers=auth, timeout=10)
    except httpx.HTTPError as e:
        raise transfer_failed(f"prefill worker {prefill_url} unreachable ({type(e).__name__})") from None
    if r.status_code != 200:
        raise transfer_failed(f"prefill worker answered {r.status_code} for transfer {transfer_id}")
    try:
        return manifest_from_dict(r.json())
    except (TransferError, ValueError) as e:
        raise transfer_failed(str(e)) from None


def add_routes(app: FastAPI, transfer_timeout: float) -> None:
    async def release_at_prefill(client, prefill_url: str, transfer_id: str, auth: dict) -> None:
        try:
            await client.post(f"{prefill_url}/internal/release/{transfer_id}", headers=auth, timeout=10)
        except httpx.HTTPError:
            pass  # the prefill worker frees parked pages on its own timeout

    async def decode(request: Request, chat: bool):
        s = request.app.state.server
        transfer: KVTransfer = request.app.state.transfer
        client: httpx.AsyncClient = request.app.state.http
        p = await prepare(s, request, chat)
        prompt = single_prompt(p)
        prefill_url, transfer_id = request.headers.get(PREFILL_URL_HEADER), request.headers.get(TRANSFER_ID_HEADER)
        if prefill_url is None or transfer_id is None:
            raise APIError(400, "decode workers take requests from the router only", code="not_routed")
        auth = {"Authorization": request.headers["authorization"]} if "authorization" in request.headers else {}
        expected = len(prompt) - 1
        legacy = faults.decode_trusts_reservation(s.engine)
        manifest = await fetch_manifest(client, prefill_url, transfer_id, auth) if transfer_id else None
        if manifest is not None and not legacy:
            try:
                verify(manifest, expected, s.engine.pool, None)
            except TransferError as e:
                await release_at_prefill(client, prefill_url, transfer_id, auth)
                raise transfer_failed(str(e)) from None
        handle = s.start_stream()
        rid = handle.ids[0]
        try:
            req = await s.async_engine.call(lambda e: e.reserve_remote(prompt, p.params, rid, p.tenant, expected))
        except InvalidRequest as e:
            handle.close()
            await release_at_prefill(client, prefill_url, transfer_id, auth)
            raise APIError(400, e.message, param=e.param, code=e.code) from None
        received = 0
        if manifest is not None:
            pages = list(req.block_table)
            try:
                await asyncio.to_thread(transfer.read, manifest, pages[:manifest.page_count], transfer_timeout)
                if not legacy:
                    sums = await asyncio.to_thread(transfer.checksums, pages, expected)
                    verify(manifest, expected, s.engine.pool, sums)
            except TransferError as e:
                handle.close()
                log.error("request %s: %s", rid, e)
                raise transfer_failed(str(e)) from None
            finally:
                await release_at_prefill(client, prefill_url, transfer_id, auth)
            received = manifest.token_count
        await s.async_engine.call(lambda e: e.activate_remote(rid, received, expected))
        return await respond(s, p, handle, request)

    @app.post("/internal/decode/v1/completions")
    async def decode_completion(request: Request):
        return await decode(request, chat=False)

    @app.post("/internal/decode/v1/chat/completions")
    async def decode_chat(request: Request):
        return await decode(request, chat=True)
