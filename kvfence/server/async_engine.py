"""Runs the engine loop in its own thread and hands each request's outputs to asyncio.

Torch releases the GIL inside its kernels, so HTTP handling on the event loop and the
engine's steps overlap; the engine only ever runs on this one thread.
"""

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvfence.engine.llm_engine import LLMEngine, Unavailable
from kvfence.engine.output import RequestOutput, merged
from kvfence.engine.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger("kvfence.server")
STREAM_STALL_TIMEOUT_S = 30.0
# A lost engine thread ends the process, with this code, once clients have had their errors
ENGINE_LOST_EXIT_CODE = 70
ENGINE_LOST_GRACE_S = 2.0
LOST = "the engine thread stopped; the process exits for a supervisor to restart it"


class Overloaded(Exception):
    """Too many requests in flight; the client should retry later."""


class ClientDisconnected(Exception):
    """The client closed its connection; the request was aborted."""


class StreamStalled(Exception):
    """The client stopped taking outputs for too long; the request was aborted."""


class EngineFailed(Exception):
    """The engine could not end the request cleanly after a failure of its own."""


@dataclass
class _Stream:
    handle: "RequestHandle"
    offset: int  # choice index of this prompt's first completion


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_pending: int,
        stall_timeout: float = STREAM_STALL_TIMEOUT_S,
    ):
        self.engine = engine
        self.max_pending = max_pending  # sequences (prompts x n) in flight
        self.stall_timeout = stall_timeout
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._in_flight = 0
        self._held: dict[str, int] = {}  # request id -> sequences counted until the engine drops it
        self._lock = threading.Lock()
        self.lost = False  # the engine thread stopped: nothing is served any more
        self._thread = threading.Thread(target=self._run, name="kvfence-engine", daemon=True)
        self._thread.start()

    async def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        tenant: str,
        charge: Callable[[int], None] | None = None,
        on_release: Callable[["RequestHandle"], None] | None = None,
    ) -> "RequestHandle":
        """Opens the request's streams (Overloaded or InvalidRequest past max_pending), then has
        the engine thread admit every prompt or none and `charge` the tokens admission allows
        it (LLMEngine.add_requests): a refusal is raised here, before any output, and leaves
        nothing queued. `on_release` runs once the request holds no slot any more."""
        handle = self.open(len(prompts), params.n)
        handle.on_release = on_release
        ids = dict(zip(handle.ids, prompts))
        added = asyncio.ensure_future(
            self.call(lambda e: e.add_requests(ids, params, tenant, charge))
        )
        try:
            await asyncio.shield(added)
        except BaseException:
            # Cancelled or refused: end the request once the engine thread has admitted or
            # refused it (it does either way), however often this task is cancelled.
            added.add_done_callback(lambda f: (f.cancelled() or f.exception(), handle.close()))
            raise
        return handle

    def open(self, num_prompts: int, n: int, held: bool = False) -> "RequestHandle":
        """Registers the output streams of a request about to enter the engine; it counts as
        num_prompts x n sequences toward max_pending, `held` ones until the engine has let go
        of their pages (KV parked for a reader, or under transfer), even after the stream closes."""
        sequences = num_prompts * max(n, 1)  # an invalid n is admission's to refuse
        if sequences > self.max_pending:  # never fits: retrying would not help
            raise InvalidRequest(
                f"the request asks for {sequences} sequences ({num_prompts} prompts x n={n}); this "
                f"server runs at most {self.max_pending} at once",
                "n",
                "too_many_sequences",
            )
        with self._lock:
            if self._in_flight + sequences > self.max_pending:
                raise Overloaded(
                    f"{self._in_flight} sequences in flight, the limit is {self.max_pending}"
                )
            self._in_flight += sequences
        ids = [uuid.uuid4().hex for _ in range(num_prompts)]
        handle = RequestHandle(self, ids, sequences, self.stall_timeout, held)
        for i, rid in enumerate(ids):
            self._streams[rid] = _Stream(handle, i * n)
        return handle

    def post(self, fn) -> None:
        """Runs fn(engine) on the engine thread, without waiting (callable from any thread)."""
        self._inbox.put(("call", None, fn))

    async def call(self, fn):
        """Runs fn(engine) on the engine thread (the only thread that touches the engine)."""
        if self.lost:
            raise Unavailable(LOST)
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", future, fn))
        return await future

    def _close(self, handle: "RequestHandle") -> None:
        for rid in handle.ids:
            self._streams.pop(rid, None)
            if handle.remaining:
                self._inbox.put(("abort", rid))

    def _release(self, handle: "RequestHandle") -> None:
        """The handle's sequences stop counting toward max_pending: now, or for a held one once
        the engine has let go of their pages."""
        with self._lock:
            if handle.held:
                self._held.update(
                    (rid, handle.num_sequences // len(handle.ids)) for rid in handle.ids
                )
            else:
                self._in_flight -= handle.num_sequences
        if handle.held:
            self._inbox.put(("call", None, lambda engine: None))  # wakes the loop to settle it

    def _settle_held(self) -> None:
        """Stops counting held requests the engine has let go of (engine thread)."""
        e = self.engine
        with self._lock:
            gone = [r for r in self._held if not e.holds(r)]
            for rid in gone:
                self._in_flight -= self._held.pop(rid)

    def _deliver(self, request_id: str, out: RequestOutput) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream.handle.loop.call_soon_threadsafe(stream.handle.put, stream.offset + out.index, out)

    def _handle(self, message: tuple) -> None:
        kind, rid, *rest = message
        if kind == "call":
            future, fn = rid, rest[0]
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # handed to the awaiting coroutine
                result, error = None, e
            if self._held:  # what fn freed no longer counts by the time its caller hears back
                self._settle_held()
            if future is not None:
                future.get_loop().call_soon_threadsafe(_settle, future, result, error)
            elif error is not None:
                log.error("engine call failed: %s", error)
            return
        if kind == "abort":
            self.engine.abort(rid)

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # only a failure of the failure handling itself gets here
            self.lost = True
            log.critical(
                "the engine thread stopped; exiting with code %d so that a supervisor restarts "
                "the server",
                ENGINE_LOST_EXIT_CODE,
            )
            self._tell_everyone()
            threading.Timer(ENGINE_LOST_GRACE_S, os._exit, (ENGINE_LOST_EXIT_CODE,)).start()

    def _tell_everyone(self) -> None:
        """The engine is lost: every waiting call and every open stream gets its error."""
        while not self._inbox.empty():
            kind, future, *_ = self._inbox.get_nowait()
            if kind == "call" and future is not None:
                future.get_loop().call_soon_threadsafe(_settle, future, None, Unavailable(LOST))
        for stream in list(self._streams.values()):
            stream.handle.loop.call_soon_threadsafe(stream.handle.cancel, EngineFailed(LOST))

    def _loop(self) -> None:
        while True:
            try:
                if not self.engine.has_unfinished():
                    try:
                        self._handle(self._inbox.get(timeout=0.5))
                    except queue.Empty:
                        pass
                while not self._inbox.empty():
                    self._handle(self._inbox.get_nowait())
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                if self._held:
                    self._settle_held()
            except Exception:  # fail every live request loudly, keep serving
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all("internal error in the engine step")

    def _fail_all(self, error: str) -> None:
        """Fails every request in the engine (FAILED, not a client's abort); one that cannot
        be ended cleanly is dropped and its client told, the thread goes on."""
        for rid in list(self.engine.requests):
            try:
                outputs = self.engine.abort(rid, error)
            except Exception:
                log.exception("request %s could not be ended cleanly; dropping it", rid)
                for req in self.engine.requests.pop(rid, []):
                    self.engine.scheduler.remove(req)
                stream = self._streams.get(rid)
                if stream is not None:
                    stream.handle.loop.call_soon_threadsafe(
                        stream.handle.cancel, EngineFailed(error)
                    )
                continue
            for out in outputs:
                self._deliver(rid, out)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class RequestHandle:
    """One submitted API request (one or more prompts, n completions each). Outputs that
    arrive before the reader took the previous one are merged, so a reader that falls behind
    holds at most one pending output per choice, however long it does not read."""

    def __init__(
        self,
        engine: AsyncEngine,
        ids: list[str],
        num_sequences: int,
        stall_timeout: float,
        held: bool = False,
    ):
        self.engine = engine
        self.held = held
        self.generated = 0  # tokens delivered, read or not
        self.on_release = None  # called with this handle once it holds no slot any more
        self.ids = ids
        self.num_sequences = self.remaining = num_sequences
        self.running = num_sequences  # sequences the engine has not finished
        self.released = False
        self.stall_timeout = stall_timeout
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._pending: dict[int, RequestOutput] = {}  # choice index -> output not yet taken
        self._unread_since: float | None = None  # when the pending outputs started waiting
        self._ended: Exception | None = None  # why the request was ended early
        self._ready = asyncio.Event()

    def put(self, index: int, item: RequestOutput) -> None:
        """Takes one delivery of the engine thread (on the event loop)."""
        if self.closed:
            return
        self.generated += len(item.delta_token_ids)
        if item.finished:
            self.running -= 1
            if not self.running:  # done in the engine: the slots go back, read or not
                self.release()
        held = self._pending.get(index)
        self._pending[index] = item if held is None else merged(held, item)
        now = time.monotonic()
        if self._unread_since is None:
            self._unread_since = now
        elif now - self._unread_since > self.stall_timeout:
            log.warning(
                "request %s: the client read nothing for %g s; aborting it",
                self.ids[0],
                self.stall_timeout,
            )
            self.cancel(
                StreamStalled(
                    f"the client stopped reading the stream for over "
                    f"{self.stall_timeout:g} s, so the request was aborted"
                )
            )
            return
        self._ready.set()

    async def next(self, timeout: float | None = None) -> tuple[int, RequestOutput]:
        """The next (choice index, output), with everything new for that choice. Raises
        TimeoutError after `timeout` seconds, or the reason the request was ended early."""
        if not self._pending and self._ended is None:
            self._ready.clear()
            await asyncio.wait_for(self._ready.wait(), timeout)
        if self._ended is not None:
            raise self._ended
        index = next(iter(self._pending))
        out = self._pending.pop(index)
        self._unread_since = time.monotonic() if self._pending else None
        if out.finished:
            self.remaining -= 1
        return index, out

    def cancel(self, reason: Exception) -> None:
        """Ends the request early (aborted, pages freed); next() then raises `reason`."""
        self._ended = reason
        self._pending.clear()
        self._ready.set()
        self.close()

    def close(self) -> None:
        """Ends the request; whatever is still running is aborted and its pages freed."""
        if not self.closed:
            self.closed = True
            self.engine._close(self)
            self.release()

    def release(self) -> None:
        """Gives back the request's slots (--max-pending, its tenant's limits), once: when the
        engine has finished it or when it closes, whichever comes first, whatever the client
        does."""
        if not self.released:
            self.released = True
            self.engine._release(self)
            if self.on_release:
                self.on_release(self)

    def detach(self) -> None:
        """Stops listening but leaves the request in the engine (a parked prefill)."""
        self.remaining = 0
        self.close()
