"""What each refusal of the engine or the server is over HTTP, and the SSE reader of clients."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from kvfence import sse
from kvfence.engine.sampling_params import InvalidRequest
from kvfence.server.async_engine import Overloaded, StreamStalled
from kvfence.server.errors import (
    APIError,
    api_error,
    api_errors,
    bad_gateway,
    error_response,
    raise_if_failed,
)
from kvfence.server.quotas import OverQuota


@pytest.mark.parametrize(
    "refusal, status, type_, param, code, headers",
    [
        (
            InvalidRequest("temperature must be in [0, 2]", "temperature"),
            400,
            "invalid_request_error",
            "temperature",
            "invalid_request",
            None,
        ),
        (
            InvalidRequest("too many", "n", "too_many_sequences"),
            400,
            "invalid_request_error",
            "n",
            "too_many_sequences",
            None,
        ),
        (
            OverQuota("tenant 'a' is over its tokens per minute", 2.5),
            429,
            "rate_limit_error",
            None,
            "rate_limit_exceeded",
            {"Retry-After": "3"},
        ),
        (
            Overloaded("9 sequences in flight, the limit is 8"),
            429,
            "rate_limit_error",
            None,
            "too_many_requests",
            {"Retry-After": "1"},
        ),
        (
            StreamStalled("the client stopped reading"),
            408,
            "timeout_error",
            None,
            "stream_stalled",
            None,
        ),
    ],
)
def test_refusal_becomes_its_api_error(refusal, status, type_, param, code, headers):
    err = api_error(refusal)
    assert (err.status, err.type, err.param, err.code) == (status, type_, param, code)
    assert err.headers == headers
    assert err.body() == {
        "error": {"message": err.message, "type": type_, "param": param, "code": code}
    }
    with pytest.raises(APIError) as raised, api_errors():
        raise refusal
    assert raised.value.body() == err.body() and raised.value.__suppress_context__


def test_messages_carry_over():
    assert api_error(InvalidRequest("the prompt is empty")).message == "the prompt is empty"
    assert api_error(Overloaded("9 in flight")).message == "server busy: 9 in flight; retry shortly"


def test_other_errors_pass_through():
    with pytest.raises(KeyError), api_errors():
        raise KeyError("not a refusal")
    with pytest.raises(TypeError):
        api_error(RuntimeError("not a refusal"))


def test_error_response():
    r = error_response(api_error(OverQuota("over", 1)))
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert json.loads(r.body)["error"]["code"] == "rate_limit_exceeded"
    gateway = bad_gateway("decode worker gone", "decode_unavailable")
    assert (gateway.status, gateway.type) == (502, "internal_error")
    assert gateway.code == "decode_unavailable"


def test_failed_output_is_500():
    with pytest.raises(APIError) as raised:
        raise_if_failed(SimpleNamespace(error="internal error in the engine step"))
    assert (raised.value.status, raised.value.type, raised.value.code) == (
        500,
        "internal_error",
        "request_failed",
    )
    raise_if_failed(SimpleNamespace(error=None))


def read(body: str) -> list:
    response = httpx.Response(200, content=body.encode())

    async def collect():
        return [e async for e in sse.events(response)]

    events = asyncio.run(collect())
    assert response.is_stream_consumed  # read to the end, past [DONE]
    return events


def test_events_up_to_done():
    body = (
        sse.event({"choices": [{"text": "é"}]})
        + ": keep-alive comment\n\n"
        + "event: x\n"
        + sse.event({"usage": {"completion_tokens": 1}})
        + sse.DONE
        + sse.event({"after": "done"})
    )
    assert read(body) == [
        {"choices": [{"text": "é"}]},
        {"usage": {"completion_tokens": 1}},
    ]


def test_error_event_is_an_event():
    body = sse.event(api_error(StreamStalled("stalled")).body()) + sse.DONE
    assert read(body)[0]["error"]["code"] == "stream_stalled"


def test_malformed_data_line():
    with pytest.raises(ValueError):
        read(sse.event({"ok": 1}) + "data: {not json\n\n" + sse.DONE)
