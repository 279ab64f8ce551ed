"""The router: the front door of a disaggregated deployment, with the same OpenAI API.

It works sequentially: the prefill worker first, which admits the request and computes
its KV; then, only if that succeeded, a decode worker, which pulls the KV and generates.
With --api-keys the router holds the tenants' limits, so that a tenant is charged once
however many workers serve it: a request in flight before the prefill, then the prompt and
max_tokens the prefill worker admitted, refunded what the decode worker did not generate.
A request the prefill side refuses ends with the prefill's own error. Workers are picked
round robin; each worker authenticates the client's key itself, and the router proves it is
the cluster with the internal token. Of a client's headers only the key and content type go
on, so no client can set the internal ones.
"""

import itertools
import json
import logging
from dataclasses import MISSING, dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvfence import sse
from kvfence.disagg import read_internal_token, worker_client
from kvfence.disagg.decode import PREFILL_URL_HEADER, TRANSFER_ID_HEADER
from kvfence.options import option
from kvfence.server.auth import ApiKeys
from kvfence.server.errors import (
    APIError,
    api_error,
    bad_gateway,
    error_response,
    invalid_api_key,
)
from kvfence.server.listener import Listener, read_body, serve
from kvfence.server.quotas import Charge, OverQuota, Quotas

log = logging.getLogger("kvfence.router")
FORWARDED_HEADERS = ("authorization", "content-type")


@dataclass(kw_only=True)
class RouterOptions(Listener):
    prefill: list[str] = option(MISSING, "prefill worker URL (repeat)", metavar="URL")
    decode: list[str] = option(MISSING, "decode worker URL (repeat)", metavar="URL")
    internal_token_file: str | None = option(
        None,
        "file holding the cluster secret that router and workers share; every /internal/* "
        "call needs it (required)",
        metavar="FILE",
    )
    api_keys: str | None = option(
        None,
        "the workers' --api-keys file: a request without one of its keys is refused before "
        "its body is read (the workers check the key again), and the router holds the "
        "tenants' limits",
        metavar="FILE",
    )


@dataclass
class Bill:
    """What a routed request is charged to its tenant: one sequence and a first token before
    its prefill, then its prompt and max_tokens once the prefill worker has admitted them;
    at the end, what it did not generate comes back (a request refused costs nothing)."""

    quotas: Quotas
    charge: Charge | None = None
    kept: int = 0  # tokens that stay charged whatever happens next: the prompt computed
    settled: bool = False

    def add(self, prompt_tokens: int, max_tokens: int) -> None:
        """The prompt is computed: charged whatever the limit; then max_tokens, or OverQuota."""
        if self.charge is not None:
            self.quotas.add(self.charge, prompt_tokens - 1)
            self.kept = prompt_tokens
            self.quotas.extend(self.charge, max_tokens)

    def settle(self, generated: int | None = 0) -> None:
        """Frees the sequence; refunds what was not generated, or nothing where that is not
        known (a stream that broke off, or whose client left, before its count arrived)."""
        if self.charge is not None and not self.settled:
            self.settled = True
            unused = 0 if generated is None else self.charge.tokens[1] - self.kept - generated
            self.quotas.refund(self.charge, unused)


def run_router(options: RouterOptions) -> int:
    token = read_internal_token(options.internal_token_file, "kvfence router")
    keys = ApiKeys.from_file(options.api_keys) if options.api_keys else ApiKeys()
    if options.public and not keys.enabled:
        log.warning(
            "WARNING: routing on %s without --api-keys: a client's body is read before any "
            "worker checks its key",
            options.host,
        )
    serve(create_router(options.prefill, options.decode, token, options, keys), options)
    return 0


def _error(message: str, code: str) -> JSONResponse:
    return error_response(bad_gateway(message, code))


def create_router(
    prefill_urls: list[str],
    decode_urls: list[str],
    internal_token: str,
    listener: Listener | None = None,
    keys: ApiKeys | None = None,
    timeout: float = 600,
) -> FastAPI:
    listener, keys = listener or Listener(), keys or ApiKeys()
    app = FastAPI(title="kvfence router")
    prefill_urls = [u.rstrip("/") for u in prefill_urls]
    decode_urls = [u.rstrip("/") for u in decode_urls]
    turns = {id(prefill_urls): itertools.count(), id(decode_urls): itertools.count()}

    def in_turn(urls: list[str]) -> list[str]:
        """Every worker of one role once, starting with the next in that role's round robin."""
        start = next(turns[id(urls)]) % len(urls)
        return urls[start:] + urls[:start]

    client = worker_client(internal_token, timeout)
    quotas = Quotas(keys)
    registry = CollectorRegistry()
    routed = Counter(
        "kvfence_router_requests", "Requests by outcome", ["outcome"], registry=registry
    )

    @app.get("/health")
    async def health():
        # Counts only: worker addresses are not for clients.
        return {
            "status": "ok",
            "role": "router",
            "prefill_workers": len(prefill_urls),
            "decode_workers": len(decode_urls),
        }

    @app.get("/metrics")
    async def metrics():
        return Response(
            generate_latest(registry),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    @app.get("/v1/models")
    async def models(request: Request):
        url = in_turn(prefill_urls)[0]
        try:
            r = await client.get(url + "/v1/models", headers=_forward(request))
        except httpx.HTTPError:
            return _error(f"prefill worker {url} unreachable", "prefill_unavailable")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def route(request: Request, path: str):
        bill = Bill(quotas)
        try:
            tenant = keys.tenant_for(request.headers.get("authorization"))
            if keys.enabled and tenant is None:
                raise invalid_api_key()
            body = await read_body(request, listener)
            if keys.enabled:
                bill.charge = quotas.charge(tenant, 1, 1)
        except (APIError, OverQuota) as e:
            routed.labels("refused_at_router").inc()
            return error_response(e if isinstance(e, APIError) else api_error(e))
        try:
            response = await forward(request, path, body, bill)
        except BaseException:
            bill.settle()
            raise
        if not isinstance(response, StreamingResponse):
            bill.settle(_generated(response))
        return response

    async def forward(request: Request, path: str, body: bytes, bill: Bill):
        headers = _forward(request)
        # A worker that refuses the connection never saw the request: try the next one.
        for prefill in in_turn(prefill_urls):
            try:
                r = await client.post(
                    f"{prefill}/internal/prefill{path}", content=body, headers=headers
                )
                break
            except httpx.ConnectError:
                log.warning("prefill worker %s refuses connections; trying the next", prefill)
            except httpx.HTTPError as e:
                routed.labels("prefill_unavailable").inc()
                return _error(
                    f"prefill worker {prefill} failed: {type(e).__name__}",
                    "prefill_unavailable",
                )
        else:
            routed.labels("prefill_unavailable").inc()
            return _error("no prefill worker accepts connections", "prefill_unavailable")
        if r.status_code != 200:  # refused at prefill: the decode side never hears of it
            routed.labels("refused_at_prefill").inc()
            return Response(
                r.content,
                status_code=r.status_code,
                media_type="application/json",
                headers={k: v for k, v in r.headers.items() if k.lower() == "retry-after"},
            )
        admitted = r.json()
        transfer_id = admitted["transfer_id"]
        try:
            bill.add(admitted["prompt_tokens"], admitted["max_tokens"])
        except OverQuota as e:
            routed.labels("refused_at_router").inc()
            if transfer_id:
                await _quietly(
                    client.post(f"{prefill}/internal/release/{transfer_id}", headers=headers)
                )
            return error_response(api_error(e))
        upstream = None
        for decode in in_turn(decode_urls):
            forward = client.build_request(
                "POST",
                f"{decode}/internal/decode{path}",
                content=body,
                headers={
                    **headers,
                    PREFILL_URL_HEADER: prefill,
                    TRANSFER_ID_HEADER: transfer_id,
                },
            )
            try:
                upstream = await client.send(forward, stream=True)
                break
            except httpx.ConnectError:
                log.warning("decode worker %s refuses connections; trying the next", decode)
            except httpx.HTTPError as e:
                failure = f"decode worker {decode} failed: {type(e).__name__}"
                break
        else:
            failure = "no decode worker accepts connections"
        # No decode worker took the request, or one refused it (whoever answered, even before
        # kvfence's handler): its KV parked at the prefill worker is freed now.
        if transfer_id and (upstream is None or upstream.status_code != 200):
            await _quietly(
                client.post(f"{prefill}/internal/release/{transfer_id}", headers=headers)
            )
        if upstream is None:
            routed.labels("decode_unavailable").inc()
            return _error(failure, "decode_unavailable")
        routed.labels("ok" if upstream.status_code == 200 else "failed_at_decode").inc()
        media = upstream.headers.get("content-type", "application/json")
        if not media.startswith("text/event-stream"):
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                return _error(
                    f"decode worker {decode} failed: {type(e).__name__}",
                    "decode_unavailable",
                )
            finally:
                await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type=media)
        return StreamingResponse(
            _relay(upstream, decode, bill), status_code=upstream.status_code, media_type=media
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route(request, "/v1/chat/completions")

    @app.on_event("shutdown")
    async def close():
        await client.aclose()

    return app


def _forward(request: Request) -> dict:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


async def _quietly(coro) -> None:
    try:
        await coro
    except httpx.HTTPError:
        pass


def _generated(response: Response) -> int:
    """The tokens a whole (not streamed) answer generated, from its usage."""
    if response.status_code != 200:
        return 0
    try:
        return int(json.loads(response.body)["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return 0


async def _relay(upstream: httpx.Response, decode: str, bill: Bill):
    """Streams the decode worker's events, whole, to the client, but for the one that says how
    many tokens were generated, which settles the bill (without it, nothing is refunded); if
    the worker dies mid-stream the client gets an error event."""
    generated, pending = None, b""
    marker = sse.GENERATED.encode()
    try:
        async for chunk in upstream.aiter_raw():
            *events, pending = (pending + chunk).split(b"\n\n")
            out = b""
            for event in events:
                if event.startswith(marker):
                    generated = int(event[len(marker) :])
                else:
                    out += event + b"\n\n"
            if out:
                yield out
        if pending:
            yield pending
    except httpx.HTTPError as e:
        error = bad_gateway(
            f"decode worker {decode} failed mid-stream: {type(e).__name__}",
            "decode_unavailable",
        )
        yield (sse.event(error.body()) + sse.DONE).encode()
    finally:
        bill.settle(generated)
        await upstream.aclose()
