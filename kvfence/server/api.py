"""The OpenAI-compatible HTTP API."""

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfence import sse
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.sampling_params import SamplingParams, StructuredOutputs
from kvfence.engine.scheduler import Share
from kvfence.model.tokenizer import apply_chat_template, encode
from kvfence.server.async_engine import (
    LOST,
    STREAM_STALL_TIMEOUT_S,
    AsyncEngine,
    ClientDisconnected,
    EngineFailed,
    RequestHandle,
    StreamStalled,
)
from kvfence.server.auth import ApiKeys
from kvfence.server.errors import (
    APIError,
    api_error,
    api_errors,
    error_response,
    invalid_api_key,
    raise_if_failed,
    request_failed,
)
from kvfence.server.listener import Listener, read_body
from kvfence.server.metrics import Metrics
from kvfence.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvfence.server.quotas import Quotas
from kvfence.server.responses import Responses
from kvfence.server.tools import ToolFormat, check_tools, detect_format

log = logging.getLogger("kvfence.server")
MAX_PROMPTS_PER_REQUEST = 64
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text format


def _check_encodable(value, path: str = "") -> None:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(
                400,
                f"field '{path or 'body'}' is not valid Unicode (lone surrogate)",
                param=path or None,
                code="invalid_encoding",
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_encodable(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_encodable(v, f"{path}[{i}]")


def _is_union_tag(loc_item) -> bool:
    """Pydantic names the union member it tried in an error's location ('str', 'list[int]')."""
    return isinstance(loc_item, str) and (
        loc_item in {"str", "int", "float", "bool"} or "[" in loc_item
    )


async def parse_body(request: Request, model: type[BaseModel], listener: Listener):
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise APIError(
            415,
            f"Content-Type must be application/json, not '{content_type or 'none'}'",
            code="unsupported_media_type",
        )
    raw = await read_body(request, listener)
    # Work that grows with the body runs off the event loop, between no one's stream events.
    return await asyncio.to_thread(_decode_body, raw, model)


def _decode_body(raw: bytes, model: type[BaseModel]):
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    _check_encodable(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None
        raise APIError(
            400,
            f"invalid field '{param}': {err['msg']}",
            param=param,
            code="invalid_type",
        ) from None


class Server:
    def __init__(
        self,
        engine: LLMEngine,
        api_keys: ApiKeys,
        served_model_name: str | None = None,
        max_pending: int = 256,
        listener: Listener | None = None,
        stream_stall_timeout: float = STREAM_STALL_TIMEOUT_S,
        report_cached_tokens: bool = True,
        grammar_timeout: float = 5.0,
    ):
        self.engine = engine
        self.async_engine = AsyncEngine(engine, max_pending, stream_stall_timeout)
        self.api_keys = api_keys
        # Off where every caller shares one prefix cache: the count tells who sent a prompt.
        self.report_cached_tokens = report_cached_tokens
        self.model_name = served_model_name or engine.model_name
        self.listener = listener or Listener()
        self.metrics = Metrics(lambda: engine)
        self.tokenizer = engine.tokenizer
        self.tool_format: ToolFormat = detect_format(
            self.tokenizer.chat_template, self.tokenizer, engine.eos_token_ids
        )
        # Grammars compile on threads of their own: never on the engine's, nor on the pool
        # that parses bodies and moves KV; one at a time per tenant, so that no tenant holds
        # them all.
        self.grammars, self.grammar_timeout = engine.grammars, grammar_timeout
        self.grammar_threads = ThreadPoolExecutor(4, thread_name_prefix="grammar")
        self.grammar_threads.submit(self.grammars.tokenizer)  # built once, before any budget runs
        self.compiling: dict[str, asyncio.Lock] = {}
        self.quotas = Quotas(api_keys)
        engine.set_tenant_shares(
            {
                name: Share(t.weight, t.max_concurrent_requests)
                for name, t in api_keys.tenants.items()
            }
        )
        engine.on_finish.append(self.metrics.observe_finished)

    # --- request handling helpers ---------------------------------------------------------

    def unavailable(self) -> str | None:
        """Why this server serves no request any more, if it does not."""
        return LOST if self.async_engine.lost else self.engine.unavailable

    def tenant(self, request: Request) -> str:
        tenant = self.api_keys.tenant_for(request.headers.get("authorization"))
        if tenant is None:
            raise invalid_api_key()
        return tenant

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    async def parse(self, request: Request, model: type[BaseModel]):
        """(tenant, body) of a request for this server's model; the key is checked first."""
        tenant = self.tenant(request)
        body = await parse_body(request, model, self.listener)
        self.check_model(body.model)
        return tenant, body

    async def tokenize_prompts(self, prompt, templated: bool = False) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_request")
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise APIError(
                400,
                f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request",
                param="prompt",
            )
        texts = [p for p in prompts if isinstance(p, str)]
        if any(len(t) > self.listener.max_body_bytes for t in texts):
            raise APIError(400, "prompt too long", param="prompt", code="context_length_exceeded")
        return [
            await asyncio.to_thread(encode, self.tokenizer, p, templated)
            if isinstance(p, str)
            else list(p)
            for p in prompts
        ]

    async def compile(self, params: SamplingParams, tenant: str) -> None:
        """Compiles the request's structured output, if any, within --grammar-timeout."""
        spec = params.structured_outputs
        if spec is None:
            return
        turn = self.compiling.setdefault(tenant, asyncio.Lock())
        await turn.acquire()
        loop = asyncio.get_running_loop()
        compiling = loop.run_in_executor(self.grammar_threads, self.grammars.compile, spec, tenant)

        def done(future) -> None:  # even after its client had its answer: the turn ends
            turn.release()
            future.exception()  # read here, so that a late failure is not logged as lost

        compiling.add_done_callback(done)
        try:
            with api_errors():
                params.grammar = await asyncio.wait_for(
                    asyncio.shield(compiling), self.grammar_timeout
                )
        except TimeoutError:
            raise APIError(
                400,
                f"{spec.param} took more than {self.grammar_timeout:g} s to compile; "
                "make it smaller or simpler",
                param=spec.param,
                code="grammar_too_complex",
            ) from None

    async def start(self, prompts, params, tenant) -> RequestHandle:
        """Submits a request to the engine: admission errors become 400; once admitted, it is
        charged to its tenant's limits from the max_tokens admission allows it (never from the
        raw request), and a tenant over its limits or an overloaded server gets 429. The
        charge is refunded what the request did not generate when it ends."""
        prompt_tokens = sum(len(p) for p in prompts)
        charged = []

        def charge(tokens: int) -> None:  # on the engine thread, before anything is queued
            charged.append((self.quotas.charge(tenant, len(prompts) * params.n, tokens), tokens))

        def refund(handle: RequestHandle) -> None:
            for c, most in charged:
                self.quotas.refund(c, most - prompt_tokens - handle.generated)

        with api_errors():
            return await self.async_engine.submit(prompts, params, tenant, charge, refund)

    def start_stream(self) -> RequestHandle:
        """Opens the output stream of one request that a disaggregated worker adds itself. It
        counts toward --max-pending for as long as the engine holds its pages: parked for a
        decode worker's read, or reserved for one in progress."""
        with api_errors():
            return self.async_engine.open(1, 1, held=True)

    async def outputs(self, handle: RequestHandle, request: Request):
        """Yields (index, output) until done; stops (aborting the rest) if the client leaves."""
        watcher = asyncio.create_task(_cancel_on_disconnect(handle, request))
        started = last = time.monotonic()
        first = True
        try:
            while handle.remaining:
                try:
                    index, out = await handle.next()
                except ClientDisconnected:
                    return
                except EngineFailed as e:
                    raise request_failed(str(e)) from None
                now = time.monotonic()
                if out.delta_token_ids:
                    (self.metrics.ttft if first else self.metrics.itl).observe(
                        now - (started if first else last)
                    )
                    first, last = False, now
                yield index, out
            self.metrics.e2e.observe(time.monotonic() - started)
        finally:
            watcher.cancel()
            handle.close()


async def _cancel_on_disconnect(handle: RequestHandle, request: Request) -> None:
    """Ends the request as soon as its client goes, whether outputs are waiting or not."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel(ClientDisconnected())


@dataclass
class Prepared:
    """A parsed, tokenized and checked completion or chat request, ready for an engine."""

    body: CompletionRequest | ChatCompletionRequest
    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    tenant: str
    tools: ToolFormat | None = None  # the format calls are parsed in, when tools may be called


async def prepare(s: Server, request: Request, chat: bool) -> Prepared:
    tenant, body = await s.parse(request, ChatCompletionRequest if chat else CompletionRequest)
    with api_errors():
        body.check_supported()
        params = body.sampling_params()
        mode = body.tool_mode() if chat else "none"
        tools = s.tool_format if mode != "none" else None
        if tools:  # work that grows with the tools, off the event loop
            params.structured_outputs = await asyncio.to_thread(tool_calls, tools, body, mode)
            params.skip_special_tokens = False  # a format's start tag may be a special token
        if chat:
            messages, template_tools = await asyncio.to_thread(
                s.tool_format.render, body.conversation(), body.tools if tools else None
            )
    if chat:
        text = await render_chat(s.tokenizer, messages, template_tools)
        prompts = await s.tokenize_prompts(text, templated=True)
    else:
        prompts = await s.tokenize_prompts(body.prompt)
    await s.compile(params, tenant)
    return Prepared(body, chat, prompts, params, tenant, tools)


def tool_calls(fmt: ToolFormat, body: ChatCompletionRequest, mode) -> StructuredOutputs:
    """The constraint of an answer that may (or must) call the request's tools."""
    check_tools(body.tools, mode, body.parallel_tool_calls)
    grammar = fmt.grammar(body.tools, mode, body.parallel_tool_calls is not False)
    return StructuredOutputs(grammar=grammar, param="tools")


async def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The chat template over `messages`, off the event loop; a conversation the template
    refuses (templates raise their own errors) is a 400."""
    try:
        return await asyncio.to_thread(apply_chat_template, tokenizer, messages, tools)
    except Exception as e:
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None


async def respond(
    s: Server, p: Prepared, handle: RequestHandle, request: Request, tell_generated=False
):
    """The OpenAI response for a running request: one JSON object, or server-sent events
    (ended, with `tell_generated`, by a comment with the number of tokens generated)."""
    want_logprobs = bool(p.body.logprobs) if p.chat else p.body.logprobs is not None
    build = Responses(
        s.tokenizer,
        s.model_name,
        p.chat,
        bool(p.body.stream),
        want_logprobs,
        s.report_cached_tokens,
        p.tools,
    )
    if p.body.stream:
        include_usage = bool(p.body.stream_options and p.body.stream_options.include_usage)
        return StreamingResponse(
            _stream(s, handle, request, build, p.prompts, include_usage, tell_generated),
            media_type="text/event-stream",
        )
    finals: dict[int, RequestOutput] = {}
    async for index, out in s.outputs(handle, request):
        raise_if_failed(out)
        if out.finished:
            finals[index] = out
    return build.response(p.prompts, finals)


def create_app(
    server_factory: Callable[[], Server],
    role: str = "unified",
    serve_metrics: bool = True,
) -> FastAPI:
    """The app; `server_factory` loads the model before the first request is accepted, and
    the Server is then `app.state.server`. Prefill and decode workers add their own routes.
    Without `serve_metrics` (metrics on a listener of their own), GET /metrics answers 404."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        app.state.server = await asyncio.to_thread(server_factory)
        yield

    app = FastAPI(title="kvfence", lifespan=lifespan)

    def srv(request: Request) -> Server:
        return request.app.state.server

    def counted(request: Request, err: APIError) -> JSONResponse:
        server = getattr(request.app.state, "server", None)
        if server is not None:
            server.metrics.http_errors.labels(str(err.status), err.code or err.type).inc()
        return error_response(err)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        return counted(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return counted(request, APIError(err.status_code, str(err.detail), code=code))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, err: Exception):
        log.exception("unexpected error")
        return counted(
            request,
            APIError(
                500,
                "internal server error",
                type="internal_error",
                code="internal_error",
            ),
        )

    @app.get("/health")
    async def health(request: Request):
        s = srv(request)
        fault = s.engine.config.inject_fault
        faulty = {"fault": fault} if fault else {}
        unavailable = s.unavailable()
        if unavailable:  # a load balancer or supervisor takes this instance out
            body = {"status": "unavailable", "role": role, "reason": unavailable, **faulty}
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "role": role, **faulty}

    if serve_metrics:

        @app.get("/metrics")
        async def metrics(request: Request):
            s = srv(request)  # an admin key also gets the private series
            keys, auth = s.api_keys, request.headers.get("authorization")
            private = not keys.enabled or keys.is_admin(auth)
            return Response(s.metrics.render(private), media_type=METRICS_MEDIA_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        s = srv(request)
        s.tenant(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": s.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvfence",
                    "max_model_len": s.engine.max_model_len,
                    "kv_pool_tokens": s.engine.pool.capacity_tokens,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        s = srv(request)
        _, body = await s.parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        text = (
            body.prompt
            if body.prompt is not None
            else await render_chat(s.tokenizer, [m.as_dict() for m in body.messages])
        )
        tokens = await asyncio.to_thread(encode, s.tokenizer, text, body.messages is not None)
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": s.engine.max_model_len,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        s = srv(request)
        _, body = await s.parse(request, DetokenizeRequest)
        vocab = s.engine.model_config.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(s.tokenizer.decode, body.tokens)}

    if role == "unified":

        async def complete(request: Request, chat: bool):
            s = srv(request)
            p = await prepare(s, request, chat)
            return await respond(s, p, await s.start(p.prompts, p.params, p.tenant), request)

        add_completion_routes(app, "", complete)

    return app


def add_completion_routes(app: FastAPI, prefix: str, handler) -> None:
    """POST {prefix}/v1/completions and {prefix}/v1/chat/completions, answered by
    `await handler(request, chat)`."""

    @app.post(f"{prefix}/v1/completions")
    async def completions(request: Request):
        return await handler(request, chat=False)

    @app.post(f"{prefix}/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handler(request, chat=True)


async def _stream(
    s: Server, handle, request, build: Responses, prompts, include_usage, tell_generated
):
    """Server-sent events: one chunk per output, an error event if a request fails or its
    client stops reading, usage, [DONE]."""
    completion_tokens, cached = 0, {}
    try:
        async for index, out in s.outputs(handle, request):
            if out.error:
                yield sse.event(request_failed(out.error).body())
                handle.close()
                break
            completion_tokens += len(out.delta_token_ids)
            cached[index] = out.num_cached_tokens
            for chunk in build.chunks(index, out):
                yield sse.event(chunk)
        else:
            if include_usage:
                yield sse.event(build.usage_chunk(prompts, completion_tokens, sum(cached.values())))
    except StreamStalled as e:  # read only by a client that comes back to its stream
        yield sse.event(api_error(e).body())
    except APIError as e:  # the engine failed the request
        yield sse.event(e.body())
    if tell_generated:
        yield sse.generated(completion_tokens)
    yield sse.DONE
