"""Disaggregated serving: prefill and decode workers behind a router (router.py)."""
import httpx

# A worker keeps an idle connection open longer than its callers (the router, decode
# workers) keep it in their pools. With both at 5 s (uvicorn's and httpx's defaults), a
# caller could send on a connection the worker was closing at that instant and get a reset.
WORKER_KEEPALIVE_S = 30


def worker_client(timeout: float | None = 5.0) -> httpx.AsyncClient:
    """An HTTP client for calls to workers; it drops idle connections well before they do."""
    return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(keepalive_expiry=WORKER_KEEPALIVE_S / 6))
