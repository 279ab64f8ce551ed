"""Server-sent events as OpenAI-compatible servers send them: `data: JSON` events, the last
one `data: [DONE]`. The server writes them with `event` and `DONE`; clients that know a
server only over HTTP (the benchmark, the audit) read them with `events`, so this module
imports nothing of the server or the engine."""

import json
from collections.abc import AsyncIterator

import httpx

DATA = "data: "
DONE = f"{DATA}[DONE]\n\n"


# A comment event a decode worker ends its stream with: the tokens it generated, which the
# router refunds the tenant's charge from. Clients pass comments over.
GENERATED = ": generated-tokens "


def event(obj) -> str:
    return f"{DATA}{json.dumps(obj, ensure_ascii=False)}\n\n"


def generated(tokens: int) -> str:
    return f"{GENERATED}{tokens}\n\n"


async def events(response: httpx.Response) -> AsyncIterator:
    """The decoded JSON of each data event of a streamed response, up to `data: [DONE]`.
    Other lines (blank separators, comments) are passed over; a data line that is not JSON
    raises ValueError."""
    done = False
    async for line in response.aiter_lines():
        if done or not line.startswith(DATA):
            continue
        if line == DONE.rstrip("\n"):
            done = True  # read on to the end: a fully read response frees its connection for reuse
            continue
        yield json.loads(line[len(DATA) :])
