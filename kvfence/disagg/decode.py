"""Decode worker: pulls a prompt's KV from a prefill worker, checks it, and generates.

POST /internal/decode/v1/{completions,chat/completions} takes the client's body plus two
headers from the router (which alone holds the cluster token that lets it call here) naming
the prefill worker and the transfer. The worker counts the request, admits it against its
own pool, reserves pages, reads the KV over NIXL, checks the manifest and every page's
checksum, and only then lets the request decode after exactly the tokens it received. Any
mismatch, timeout or dead peer fails the request with an error (never 200 with text); the
reserved pages are freed once the read has returned, never while it may still write them.
"""

import asyncio
import logging
import re
import time

import httpx
from fastapi import FastAPI, Request

from kvfence.disagg.prefill import single_prompt
from kvfence.disagg.transfer import (
    KVTransfer,
    Manifest,
    TransferError,
    manifest_from_dict,
)
from kvfence.server.api import add_completion_routes, prepare, respond
from kvfence.server.errors import REFUSALS, APIError, api_error, bad_gateway

PREFILL_URL_HEADER = "x-kvfence-prefill-url"
TRANSFER_ID_HEADER = "x-kvfence-transfer-id"
TRANSFER_ID = re.compile(r"[0-9a-f]{32}")  # the prefill worker's request ids (uuid4 hex)
LEASE_MARGIN_S = 1.0  # the read ends this long before the prefill worker's lease on the pages
log = logging.getLogger("kvfence.decode")


def transfer_failed(message: str) -> APIError:
    return bad_gateway(
        f"KV transfer from the prefill worker failed: {message}", "kv_transfer_failed"
    )


def routed_transfer(request: Request, prompt: list[int]) -> tuple[str, str]:
    """The router's (prefill URL, transfer id), checked for form: an empty transfer (no KV)
    is only right for a one-token prompt, whose single token the decode side computes."""
    prefill_url, transfer_id = (
        request.headers.get(PREFILL_URL_HEADER),
        request.headers.get(TRANSFER_ID_HEADER),
    )
    if prefill_url is None or transfer_id is None:
        raise APIError(400, "decode workers take requests from the router only", code="not_routed")
    if transfer_id and not TRANSFER_ID.fullmatch(transfer_id):
        raise APIError(400, "malformed transfer id", code="invalid_transfer")
    if not transfer_id and len(prompt) > 1:
        raise APIError(
            400,
            f"a prompt of {len(prompt)} tokens needs the KV of {len(prompt) - 1}: "
            "an empty transfer carries none",
            code="invalid_transfer",
        )
    return prefill_url.rstrip("/"), transfer_id


async def fetch_manifest(
    client: httpx.AsyncClient,
    prefill_url: str,
    transfer_id: str,
    auth: dict,
    deadline: float,
) -> Manifest:
    """The manifest from the prefill worker; its errors are logged, not echoed to the client."""
    try:
        r = await client.get(
            f"{prefill_url}/internal/transfer/{transfer_id}",
            headers=auth,
            timeout=max(deadline - time.monotonic(), 0.001),
        )
    except httpx.TimeoutException:
        raise transfer_failed(
            "the transfer did not finish within its deadline (fetching the manifest)"
        ) from None
    except httpx.HTTPError as e:
        raise transfer_failed(f"prefill worker unreachable ({type(e).__name__})") from None
    if r.status_code != 200:
        raise transfer_failed(f"prefill worker answered {r.status_code} for the manifest")
    try:
        return manifest_from_dict(r.json())
    except (TransferError, ValueError) as e:
        log.error("transfer %s: %s", transfer_id, e)
        raise transfer_failed("malformed manifest") from None


def add_routes(app: FastAPI, transfer_timeout: float) -> None:
    async def release_at_prefill(client, prefill_url: str, transfer_id: str, auth: dict) -> None:
        try:
            await client.post(
                f"{prefill_url}/internal/release/{transfer_id}",
                headers=auth,
                timeout=10,
            )
        except httpx.HTTPError:
            pass  # the prefill worker frees parked pages when their lease ends

    async def release_routed(client, request: Request, auth: dict) -> None:
        """Frees the parked KV of the transfer the router named, if it named one."""
        prefill_url = request.headers.get(PREFILL_URL_HEADER)
        transfer_id = request.headers.get(TRANSFER_ID_HEADER, "")
        if prefill_url and TRANSFER_ID.fullmatch(transfer_id):
            await release_at_prefill(client, prefill_url.rstrip("/"), transfer_id, auth)

    async def pull(
        s,
        manifest: Manifest,
        rid: str,
        pages: list[int],
        expected: int,
        deadline: float,
        prefill_url: str,
        auth: dict,
    ) -> str | None:
        """Reads the KV into the reserved pages and checks it; returns an error or None. The
        engine hears that the read has returned in any case, even if the caller is cancelled."""
        transfer: KVTransfer = app.state.transfer
        received = None
        try:
            await asyncio.to_thread(transfer.read, manifest, pages[: manifest.page_count], deadline)
            sums = await asyncio.to_thread(transfer.checksums, pages, expected)
            transfer.verify(manifest, expected, sums)
            received = manifest.token_count
            return None
        except TransferError as e:
            log.error("request %s: %s", rid, e)
            return str(e)
        finally:
            s.async_engine.post(lambda e: e.end_transfer(rid, received))
            await release_at_prefill(app.state.http, prefill_url, manifest.transfer_id, auth)

    async def decode(request: Request, chat: bool):
        deadline = time.monotonic() + transfer_timeout  # one deadline for the whole transfer
        s = request.app.state.server
        client: httpx.AsyncClient = request.app.state.http
        auth = (
            {"Authorization": request.headers["authorization"]}
            if "authorization" in request.headers
            else {}
        )
        handle = None
        try:
            p = await prepare(s, request, chat)
            prompt = single_prompt(p)
            prefill_url, transfer_id = routed_transfer(request, prompt)
            expected = len(prompt) - 1
            handle = s.start_stream()  # counted toward --max-pending before any call out
            rid = handle.ids[0]
            manifest = None
            if transfer_id:
                manifest = await fetch_manifest(client, prefill_url, transfer_id, auth, deadline)
                deadline = min(deadline, time.monotonic() + manifest.lease_s - LEASE_MARGIN_S)
                try:
                    request.app.state.transfer.verify(manifest, expected)
                except TransferError as e:
                    raise transfer_failed(str(e)) from None
            req = await s.async_engine.call(
                lambda e: e.reserve(prompt, p.params, rid, p.tenant, expected)
            )
        except BaseException as e:
            # Refused or failed here (a bad request, a busy worker, a bad manifest): the KV
            # parked for it at the prefill worker is freed now, not at the end of its lease.
            if handle is not None:
                handle.close()
            await release_routed(client, request, auth)
            if isinstance(e, REFUSALS):
                raise api_error(e) from None
            raise
        if manifest is None:
            await s.async_engine.call(lambda e: e.end_transfer(rid, 0))
        else:
            # Shielded: a cancelled handler must not end the request while the read runs.
            error = await asyncio.shield(
                asyncio.ensure_future(
                    pull(
                        s,
                        manifest,
                        rid,
                        list(req.block_table),
                        expected,
                        deadline,
                        prefill_url,
                        auth,
                    )
                )
            )
            if error is not None:
                handle.close()
                raise transfer_failed(error)
        return await respond(s, p, handle, request, tell_generated=True)

    add_completion_routes(app, "/internal/decode", decode)
