"""API errors: the OpenAI error body, and what the engine's and the server's refusals are
over HTTP. The API, the disaggregated workers and the router all answer with these."""

from contextlib import contextmanager

from fastapi.responses import JSONResponse

from kvfence.engine.llm_engine import Unavailable
from kvfence.engine.output import RequestOutput
from kvfence.engine.sampling_params import InvalidRequest
from kvfence.server.async_engine import Overloaded, StreamStalled
from kvfence.server.quotas import OverQuota

# What a client can be told it did, or must wait for; anything else is an internal error.
REFUSALS = (InvalidRequest, OverQuota, Overloaded, StreamStalled, Unavailable)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def api_error(e: Exception) -> APIError:
    """The APIError for one of the REFUSALS."""
    if isinstance(e, InvalidRequest):
        return APIError(400, e.message, param=e.param, code=e.code)
    if isinstance(e, OverQuota):
        return APIError(
            429,
            str(e),
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(e.retry_after)},
        )
    if isinstance(e, Overloaded):
        return APIError(
            429,
            f"server busy: {e}; retry shortly",
            type="rate_limit_error",
            code="too_many_requests",
            headers={"Retry-After": "1"},
        )
    if isinstance(e, StreamStalled):
        return APIError(408, str(e), type="timeout_error", code="stream_stalled")
    if isinstance(e, Unavailable):
        return APIError(503, str(e), type="internal_error", code="service_unavailable")
    raise TypeError(f"{type(e).__name__} is not a refusal a client can be told of")


@contextmanager
def api_errors():
    """Raises the APIError of any of the REFUSALS raised in the block."""
    try:
        yield
    except REFUSALS as e:
        raise api_error(e) from None


def invalid_api_key() -> APIError:
    return APIError(
        401, "invalid or missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key"
    )


def request_failed(message: str) -> APIError:
    """A request the engine failed after it was admitted."""
    return APIError(500, message, type="internal_error", code="request_failed")


def raise_if_failed(out: RequestOutput) -> None:
    if out.error:
        raise request_failed(out.error)


def bad_gateway(message: str, code: str) -> APIError:
    """Another process of the deployment (a worker, a peer's KV) failed the request."""
    return APIError(502, message, type="internal_error", code=code)
