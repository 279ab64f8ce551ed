"""Disaggregated serving: prefill and decode workers behind a router (router.py).

Router and workers share a cluster secret, the internal token, that no client holds: every
`/internal/*` call carries it, and a worker refuses any that does not, whatever client key
it has. Client keys still name the tenant; the token only says the caller is the cluster.
"""

import hmac
from pathlib import Path

import httpx
from fastapi import FastAPI, Request

from kvfence.server.errors import APIError, error_response

INTERNAL_TOKEN_HEADER = "x-kvfence-internal-token"
INTERNAL_PREFIX = "/internal"
MIN_TOKEN_CHARS = 16
# A worker keeps an idle connection open longer than its callers (the router, decode
# workers) keep it in their pools. With both at 5 s (uvicorn's and httpx's defaults), a
# caller could send on a connection the worker was closing at that instant and get a reset.
WORKER_KEEPALIVE_S = 30


def read_internal_token(path: str | None, who: str) -> str:
    """The cluster secret from `path`; raises ValueError saying how to make one."""
    make = (
        "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE, "
        "and give the same file to the router and every worker (kvfence cluster makes its own)"
    )
    if path is None:
        raise ValueError(f"{who} needs --internal-token-file FILE: {make}")
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the internal token from {path}: {e}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the internal token in {path} has {len(token)} characters, at least "
            f"{MIN_TOKEN_CHARS} are needed: {make}"
        )
    return token


def require_internal_token(app: FastAPI, token: str) -> None:
    """Every /internal/* request without the cluster's token gets 401, before any handler."""
    expected = token.encode()

    @app.middleware("http")
    async def check_internal_token(request: Request, call_next):
        if request.url.path.startswith(INTERNAL_PREFIX):
            sent = request.headers.get(INTERNAL_TOKEN_HEADER, "").encode()
            if not hmac.compare_digest(sent, expected):
                return error_response(
                    APIError(
                        401,
                        "internal endpoint: only the cluster's router and workers may call it",
                        code="invalid_internal_token",
                    )
                )
        return await call_next(request)


def worker_client(token: str, timeout: float | None = 5.0) -> httpx.AsyncClient:
    """An HTTP client for calls to workers: it carries the cluster token, and drops idle
    connections well before the workers do."""
    return httpx.AsyncClient(
        timeout=timeout,
        headers={INTERNAL_TOKEN_HEADER: token},
        limits=httpx.Limits(keepalive_expiry=WORKER_KEEPALIVE_S / 6),
    )
