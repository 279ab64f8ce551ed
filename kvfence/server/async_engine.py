"""Runs the engine loop in its own thread and hands each request's outputs to asyncio.

Torch releases the GIL inside its kernels, so HTTP handling on the event loop and the
engine's steps overlap; the engine only ever runs on this one thread.
"""
import asyncio
import logging
import queue
import threading
import uuid
from dataclasses import dataclass

from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.sampling_params import SamplingParams

log = logging.getLogger("kvfence.server")


class Overloaded(Exception):
    """Too many requests in flight; the client should retry later."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    offset: int  # choice index of this prompt's first completion


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_pending: int):
        self.engine = engine
        self.max_pending = max_pending
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._in_flight = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="kvfence-engine", daemon=True)
        self._thread.start()

    def submit(self, prompts: list[list[int]], params: SamplingParams, tenant: str) -> "RequestHandle":
        """Admits the prompts or raises (InvalidRequest, Overloaded) before anything is queued."""
        for prompt in prompts:
            self.engine.validate(prompt, params)
        handle = self.open(len(prompts), params.n)
        for rid, prompt in zip(handle.ids, prompts):
            self._inbox.put(("add", rid, prompt, params, tenant))
        return handle

    def open(self, num_prompts: int, n: int) -> "RequestHandle":
        """Registers the output streams of a request about to enter the engine."""
        with self._lock:
            if self._in_flight + num_prompts > self.max_pending:
                raise Overloaded(f"{self._in_flight} requests in flight, the limit is {self.max_pending}")
            self._in_flight += num_prompts
        handle = RequestHandle(self, [uuid.uuid4().hex for _ in range(num_prompts)], num_prompts * n)
        for i, rid in enumerate(handle.ids):
            self._streams[rid] = _Stream(handle.loop, handle.queue, i * n)
        return handle

    def post(self, fn) -> None:
        """Runs fn(engine) on the engine thread, without waiting (callable from any thread)."""
        self._inbox.put(("call", None, fn))

    async def call(self, fn):
        """Runs fn(engine) on the engine thread (the only thread that touches the engine)."""
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", future, fn))
        return await future

    def _close(self, handle: "RequestHandle") -> None:
        for rid in handle.ids:
            self._streams.pop(rid, None)
            if handle.remaining:
                self._inbox.put(("abort", rid))
        with self._lock:
            self._in_flight -= len(handle.ids)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        index = stream.offset + (item.index if isinstance(item, RequestOutput) else 0)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (index, item))

    def _handle(self, message: tuple) -> None:
        kind, rid, *rest = message
        if kind == "call":
            future, fn = rid, rest[0]
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
                result, error = None, e
            if future is not None:
                future.get_loop().call_soon_threadsafe(_settle, future, result, error)
            elif error is not None:
                log.error("engine call failed: %s", error)
            return
        if kind == "abort":
            self.engine.abort(rid)
            return
        prompt, params, tenant = rest
        try:
            self.engine.add_request(prompt, params, request_id=rid, tenant=tenant)
        except Exception as e:  # noqa: BLE001 - the error goes back to the waiting client
            self._deliver(rid, e)

    def _loop(self) -> None:
        while True:
            try:
                if not self.engine.has_unfinished():
                    try:
                        self._handle(self._inbox.get(timeout=0.5))
                    except queue.Empty:
                        pass
                self.engine.expire_parked()
                while not self._inbox.empty():
                    self._handle(self._inbox.get_nowait())
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
            except Exception:  # noqa: BLE001 - fail every live request loudly, keep serving
                log.exception("engine step failed; failing the requests in flight")
                for rid in list(self.engine.requests):
                    for out in self.engine.abort(rid):
                        out.error = "internal error in the engine step"
                        out.finish_reason = "error"
                        self._deliver(rid, out)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class RequestHandle:
    """One submitted API request (one or more prompts, n completions each)."""

    def __init__(self, engine: AsyncEngine, ids: list[str], num_completions: int):
        self.engine = engine
        self.ids = ids
        self.remaining = num_completions
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def next(self, timeout: float | None = None) -> tuple[int, RequestOutput]:
        """The next (choice index, output); raises TimeoutError after `timeout` seconds."""
        index, item = await asyncio.wait_for(self.queue.get(), timeout)
        if isinstance(item, Exception):
            raise item
        if item.finished:
            self.remaining -= 1
        return index, item

    def close(self) -> None:
        """Ends the request; whatever is still running is aborted and its pages freed."""
        if not self.closed:
            self.closed = True
            self.engine._close(self)

    def detach(self) -> None:
        """Stops listening but leaves the request in the engine (a parked prefill)."""
        self.remaining = 0
        self.close()
