"""Probes a deployment's workers from a client's position: every internal endpoint must
refuse a client key (or no key at all). One that answers lets a client drive prefill or
decode directly, or read transfer manifests, which name the KV pool's addresses."""

import asyncio
from dataclasses import dataclass

import httpx

# (method, path) of the internal endpoints kvfence's prefill and decode workers serve.
INTERNAL_ENDPOINTS = [
    ("POST", "/internal/prefill/v1/completions"),
    ("POST", "/internal/prefill/v1/chat/completions"),
    ("GET", "/internal/transfer/{id}"),
    ("POST", "/internal/release/{id}"),
    ("POST", "/internal/decode/v1/completions"),
    ("POST", "/internal/decode/v1/chat/completions"),
]
REFUSED = {401, 403}
ABSENT = {404, 405}
PROBE_ID = "0" * 32
PROBE_BODY = {
    "prompt": "hi",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 1,
}


@dataclass
class Probe:
    worker: str
    method: str
    path: str
    key_index: int | None  # which client key was sent; None: no key
    status: int | None = None
    error_code: str | None = None
    failure: str | None = None  # transport failure: the endpoint could not be probed

    @property
    def answered(self) -> bool:
        """The endpoint did work for a client: neither refused nor absent. A 404 that names
        an error of its own (a transfer not found) came from the endpoint, not the router."""
        if self.status is None or self.status in REFUSED:
            return False
        return self.status not in ABSENT or self.error_code not in (None, "not_found")


async def probe_workers(urls: list[str], keys: list[str], timeout: float = 30) -> list[Probe]:
    """Sends every internal endpoint of every worker each client key, and no key."""
    probes = [
        Probe(url.rstrip("/"), method, path.format(id=PROBE_ID), k)
        for url in urls
        for method, path in INTERNAL_ENDPOINTS
        for k in [None, *range(len(keys))]
    ]
    async with httpx.AsyncClient(timeout=timeout) as client:
        await asyncio.gather(*[_send(client, p, keys) for p in probes])
    return probes


async def _send(client: httpx.AsyncClient, probe: Probe, keys: list[str]) -> None:
    headers = (
        {} if probe.key_index is None else {"Authorization": f"Bearer {keys[probe.key_index]}"}
    )
    body = PROBE_BODY if probe.method == "POST" else None
    try:
        r = await client.request(
            probe.method, probe.worker + probe.path, json=body, headers=headers
        )
    except httpx.HTTPError as e:
        probe.failure = type(e).__name__
        return
    probe.status = r.status_code
    try:
        error = r.json().get("error")
        probe.error_code = error.get("code") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        probe.error_code = None
