"""The audit's side of the wire: streamed requests, each recorded as an Exchange with its
status, text, usage and time to the first token."""

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from kvfence import sse
from kvfence.audit.prompts import join, random_words

# Token-counting endpoints: vLLM, SGLang and kvfence; llama.cpp's llama-server;
# llama-cpp-python's server.
TOKENIZERS = [
    ("/tokenize", lambda model, text: {"model": model, "prompt": text}),
    ("/tokenize", lambda model, text: {"content": text}),
    ("/extras/tokenize", lambda model, text: {"model": model, "input": text}),
]


@dataclass
class Exchange:
    phase: str
    prompt: str
    key_index: int
    secret: str | None = None
    status: int = 0
    text: str = ""
    usage: dict | None = None
    ttft: float | None = None  # seconds to the first event carrying a choice
    error: str | None = None

    @property
    def cached_tokens(self) -> int | None:
        """usage.prompt_tokens_details.cached_tokens, where the server reports it."""
        return ((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


class AuditClient:
    def __init__(self, base: str, keys: list[str | None], concurrency: int, timeout: float):
        self.base, self.keys, self.timeout = base, keys, timeout
        self.model = ""
        self.semaphore = asyncio.Semaphore(concurrency)
        self.http = httpx.AsyncClient()
        self.exchanges: list[Exchange] = []
        self.on_exchange = None  # called after each request (a progress bar)
        self.tokenizers = list(TOKENIZERS)

    def headers(self, key_index: int) -> dict:
        key = self.keys[key_index % len(self.keys)]
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def send(self, ex: Exchange, path: str, body: dict) -> Exchange:
        """Streams one request, recording status, text, usage and time to first token."""
        body = {
            **body,
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with self.semaphore:
            # A connection the server closed as it was reused (its keep-alive ran out) drops
            # the request before any answer: the request goes again once, on a new one.
            for attempt in (1, 2):
                start = time.monotonic()
                try:
                    async with self.http.stream(
                        "POST",
                        self.base + path,
                        json=body,
                        headers=self.headers(ex.key_index),
                        timeout=self.timeout,
                    ) as r:
                        ex.status = r.status_code
                        if r.status_code != 200:
                            ex.error = (await r.aread()).decode(errors="replace")[:500]
                        else:
                            await self._read_events(r, ex, start)
                    break
                except (httpx.ReadError, httpx.RemoteProtocolError) as e:
                    ex.error = f"{type(e).__name__}: {e}"
                    if ex.status or attempt == 2:
                        break
                    ex.error = None
                except httpx.HTTPError as e:
                    ex.error = f"{type(e).__name__}: {e}"
                    break
        self.exchanges.append(ex)
        if self.on_exchange:
            self.on_exchange()
        return ex

    @staticmethod
    async def _read_events(r, ex: Exchange, start: float) -> None:
        async for event in sse.events(r):
            if "error" in event:
                ex.error = event["error"].get("message", "error")
                continue
            if event.get("usage"):
                ex.usage = event["usage"]
            for choice in event.get("choices", []):
                if ex.ttft is None:
                    ex.ttft = time.monotonic() - start
                ex.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""

    async def usage_of(self, ex: Exchange, max_tokens: int) -> dict:
        """ex's usage from the same completion unstreamed, for servers whose streams carry
        none; {} if it has none either."""
        body = {"model": self.model, "prompt": ex.prompt, "max_tokens": max_tokens}
        async with self.semaphore:
            try:
                r = await self.http.post(
                    self.base + "/v1/completions",
                    json={**body, "temperature": 0},
                    headers=self.headers(ex.key_index),
                    timeout=self.timeout,
                )
                return (r.json().get("usage") or {}) if r.status_code == 200 else {}
            except (httpx.HTTPError, ValueError, AttributeError):
                return {}

    async def complete(self, ex: Exchange, max_tokens: int) -> Exchange:
        """A greedy completion of ex.prompt."""
        body = {"prompt": ex.prompt, "max_tokens": max_tokens, "temperature": 0}
        return await self.send(ex, "/v1/completions", body)

    async def dropped(self, ex: Exchange, max_tokens: int, after_s: float) -> None:
        """Starts a greedy completion of ex.prompt and closes the connection after `after_s`
        seconds, as a client that gives up does (before its first token, if that is later)."""
        try:
            await asyncio.wait_for(self.complete(ex, max_tokens), after_s)
        except TimeoutError:
            pass

    async def chat(self, ex: Exchange, max_tokens: int) -> Exchange:
        """A greedy chat answer to ex.prompt as the user's message."""
        body = {
            "messages": [{"role": "user", "content": ex.prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        return await self.send(ex, "/v1/chat/completions", body)

    async def count_tokens(self, text: str) -> int | None:
        """The server's own token count of `text`, through the first of TOKENIZERS it
        answers; None where it has none."""
        for path, body in list(self.tokenizers):
            try:
                r = await self.http.post(
                    self.base + path,
                    json=body(self.model, text),
                    headers=self.headers(0),
                    timeout=60,
                )
                if r.status_code == 200:
                    tokens = r.json()["tokens"]
                    if isinstance(tokens, list):
                        self.tokenizers = [(path, body)]  # this one works: keep only it
                        return len(tokens)
            except (httpx.HTTPError, KeyError, ValueError, TypeError):
                pass
            self.tokenizers.remove((path, body))
        return None

    async def prompt_of(self, rng: random.Random, n: int) -> str:
        """Random words that share nothing with other prompts: exactly n tokens where the
        server can count them, else about n."""
        words = random_words(rng, n)
        for _ in range(8):
            counted = await self.count_tokens(join(words))
            if counted is None or counted == n:
                break
            if counted > n:
                words = words[: max(1, len(words) - (counted - n))]
            else:
                words += random_words(rng, n - counted)
        return join(words)
