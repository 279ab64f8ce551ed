"""The engine: adds requests, runs steps, aborts, and frees every page a request held."""

import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfence import openmp
from kvfence.config import KV_CACHE_DTYPES, EngineConfig
from kvfence.engine.admission import Admission
from kvfence.engine.model_runner import ModelRunner
from kvfence.engine.output import (
    RequestOutput,
    append_token,
    finish_record,
    take_output,
)
from kvfence.engine.remote_kv import RemoteKV
from kvfence.engine.request import Request, RequestState
from kvfence.engine.request_log import RequestLog, audit_record
from kvfence.engine.sampler import sample_isolating_errors
from kvfence.engine.sampling_params import InvalidRequest, SamplingParams
from kvfence.engine.scheduler import Scheduler, Share
from kvfence.engine.structured import GrammarError, Grammars
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.pool import KVPool
from kvfence.kv.prefix_cache import PrefixCache
from kvfence.model.build import build_model
from kvfence.model.loader import model_name
from kvfence.model.tokenizer import encode, load_tokenizer

log = logging.getLogger("kvfence.engine")
request_log = logging.getLogger("kvfence.requests")


class Unavailable(Exception):
    """The engine admits no request any more (its request log cannot be written)."""


@dataclass(frozen=True)
class EngineParts:
    """The classes an engine is built of. Tests swap some for faulty ones (kvfence.testing)."""

    admission: type[Admission] = Admission
    remote_kv: type[RemoteKV] = RemoteKV
    prefix_cache: type[PrefixCache] = PrefixCache
    scheduler: type[Scheduler] = Scheduler


class LLMEngine:
    def __init__(
        self, config: EngineConfig, progress: bool = True, parts: EngineParts | None = None
    ):
        parts = parts or EngineParts()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu" and not openmp.WAIT_CHOSEN:
            log.warning(
                "torch was imported before kvfence, so OpenMP threads keep libgomp's default "
                "wait: set GOMP_SPINCOUNT=300000 in the environment for faster decoding"
            )
        self.model_path, self.model_config, model = build_model(config, progress)
        path = self.model_path
        self.model_name = model_name(path)
        self.tokenizer = load_tokenizer(path)
        eos = self.model_config.eos_token_ids or [self.tokenizer.eos_token_id]
        self.eos_token_ids = {t for t in eos if t is not None}
        self.max_model_len = config.max_model_len
        self.pool = KVPool(
            self.model_config,
            config.num_kv_pages,
            config.page_size,
            config.device,
            KV_CACHE_DTYPES[config.kv_cache_dtype],
        )
        self.allocator = PageAllocator(config.num_kv_pages, config.page_size)
        self.prefix_cache = (
            parts.prefix_cache(self.allocator, self._scrub) if config.prefix_cache else None
        )
        self.scheduler = parts.scheduler(
            self.allocator,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.release,
            self.prefix_cache,
            fair=config.scheduling == "fair",
        )
        self.runner = ModelRunner.for_config(model, self.pool, self.allocator, config)
        # Unseeded requests draw from it: seeded from the OS, so that no two engines sample
        # alike, unless a seed is configured (reproducible benchmarks).
        seed = secrets.randbits(64) if config.seed is None else config.seed
        self.generator = torch.Generator().manual_seed(seed)
        self.requests: dict[str, list[Request]] = {}
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.admission = parts.admission.of(self)
        self.remote = parts.remote_kv(self.allocator, self.prefix_cache, self._end_parked)
        self.stats = dict.fromkeys(
            ("prompt_tokens", "generation_tokens", "finished", "aborted", "failed"), 0
        )
        self.request_log = None
        if config.request_log:
            max_bytes = int(config.request_log_max_mb * 2**20)
            self.request_log = RequestLog(config.request_log, max_bytes)
        self.on_finish: list = []  # called with each finished request's record (server metrics)
        self.unavailable: str | None = None  # why no request is admitted any more

    def describe(self) -> str:
        """One line on what this engine runs, for the start-up log."""
        c = self.config
        attention = "kernel" if self.runner.decode_kernel else "torch"
        return (
            f"{self.model_name}: dtype {c.dtype}, KV pool {c.kv_cache_dtype} {c.num_kv_pages} "
            f"pages x {c.page_size} tokens ({self.pool.capacity_tokens} tokens), max_model_len "
            f"{c.max_model_len}, max_num_seqs {c.max_num_seqs}, attention {attention}, sentinel "
            f"{c.kv_sentinel}, scrub {c.kv_scrub}, prefix cache "
            f"{'on' if c.prefix_cache else 'off'}, {torch.get_num_threads()} threads on {c.device}"
        )

    # --- requests in, pages out ------------------------------------------------------

    def tokenize(self, prompt: str, templated: bool = False) -> list[int]:
        return encode(self.tokenizer, prompt, templated)

    def validate(self, prompt_ids: list[int], params: SamplingParams, kv_tokens=None) -> int:
        """Admission's check alone, for a request that needs no pages here (a one-token
        prompt's prefill)."""
        return self.admission.check(prompt_ids, params, kv_tokens)

    def check_available(self) -> None:
        if self.unavailable is not None:
            raise Unavailable(self.unavailable)

    def set_tenant_shares(self, shares: dict[str, Share]) -> None:
        """Each tenant's weight and running cap under fair scheduling (tenants not named have
        Share())."""
        self.scheduler.shares = shares

    @property
    def rejected(self) -> dict[str, int]:
        return self.admission.rejected

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tenant: str = "default",
    ) -> list[Request]:
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id or uuid.uuid4().hex
        return self.add_requests({request_id: prompt_ids}, params or SamplingParams(), tenant)[0]

    def add_requests(
        self,
        prompts: dict[str, list[int]],
        params: SamplingParams,
        tenant: str,
        charge: Callable[[int], None] | None = None,
    ) -> list[list[Request]]:
        """Admits every prompt (by request id) or none: InvalidRequest comes before anything is
        queued. `charge` is then told the most tokens admission allows the request (prompts
        and every sequence's max_tokens) and may refuse it by raising. Each prompt's n
        sequences are then queued."""
        self.check_available()
        for request_id in prompts:
            if request_id in self.requests:
                raise InvalidRequest(f"request id {request_id} is already in use", "request_id")
        admitted = {
            rid: self.admission.requests(ids, params, rid, tenant) for rid, ids in prompts.items()
        }
        if charge is not None:
            sequences = [req for children in admitted.values() for req in children]
            charge(sum(map(len, prompts.values())) + sum(r.max_tokens for r in sequences))
        for request_id, children in admitted.items():
            self._queue(request_id, children)
        return list(admitted.values())

    def _queue(self, request_id: str, children: list[Request]) -> None:
        for req in children:
            self.scheduler.add(req)
        self.requests[request_id] = children

    def holds(self, request_id: str) -> bool:
        """Whether any page is still held for the request."""
        return request_id in self.requests or self.remote.holds(request_id)

    def release(self, req: Request) -> None:
        """Gives back every page a request holds. The only place pages are freed."""
        if self.prefix_cache:  # by the allocator's records of its references, not the table
            self.prefix_cache.release(req.owner)
        self._scrub(self.allocator.free_owner(req.owner))
        req.block_table.clear()
        req.page_generations.clear()
        req.num_shared_pages = 0

    def _scrub(self, pages: list[int]) -> None:
        if self.config.kv_scrub == "on-free":
            self.pool.scrub(pages)

    def prefix_cache_stats(self) -> dict:
        c = self.prefix_cache
        return {
            "queried": c.queried_tokens if c else 0,
            "hits": c.hit_tokens if c else 0,
        }

    # --- disaggregation: KV parked for a decode worker, KV arriving from a prefill ----------

    def add_prefill_only(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
        lease_s: float,
    ) -> Request:
        """Computes the KV of every prompt token but the last, then parks the request with
        its pages for `lease_s` seconds or until the decode worker has pulled them."""
        self.check_available()
        req = self.admission.prefill_only(prompt_ids, params, request_id, tenant)
        req.lease_s = lease_s
        self._queue(request_id, [req])
        return req

    def _end_parked(self, req: Request) -> None:
        """A parked request's reader is done or its lease ended (engine/remote_kv.py)."""
        if not req.is_terminal:
            self.finish(req, RequestState.FINISHED_STOP)
            self.requests.pop(req.parent_id, None)

    def reserve(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
        kv_tokens: int,
    ) -> Request:
        """Admits a request whose first `kv_tokens` prompt tokens arrive as KV from a prefill
        worker, and reserves pages for them. It is not scheduled until end_transfer."""
        self.check_available()
        req = self.admission.remote(prompt_ids, params, request_id, tenant)
        self.remote.receive(req, kv_tokens)
        self.requests[request_id] = [req]
        return req

    def end_transfer(self, request_id: str, received_tokens: int | None) -> None:
        """The read into a receiving request's pages has returned: nothing writes them any
        more. With the KV of `received_tokens` tokens (None: the transfer failed) the request
        decodes after exactly those; aborted or failed meanwhile, its pages are freed."""
        req, computed = self.remote.received(request_id, received_tokens)
        if req.is_terminal:
            self.release(req)
        elif received_tokens is None:
            self.finish(req, RequestState.FAILED, "the KV transfer failed")
            self.requests.pop(request_id, None)
        else:
            self.runner.mark_written(req, 0, received_tokens)
            req.num_computed_tokens = computed
            req.num_prompt_tokens_computed = 0
            self.scheduler.add(req)

    def finish(self, req: Request, state: RequestState, error: str | None = None) -> None:
        self.scheduler.remove(req)
        if req.parent_id not in self.remote.receiving:  # under transfer: see end_transfer
            self.release(req)
        req.error = error
        req.set_state(state)
        key = {RequestState.ABORTED: "aborted", RequestState.FAILED: "failed"}.get(state)
        self.stats[key or "finished"] += 1
        record = finish_record(req)
        request_log.info(json.dumps(record))
        for hook in self.on_finish:
            hook(record)
        if self.request_log is not None:
            self._log_request(audit_record(record, req, self.config.kv_sentinel))

    def _log_request(self, record: dict) -> None:
        """A request the log cannot record would be served unseen: the engine then admits
        nothing more (it fails closed), and says why."""
        try:
            self.request_log.write(record)
        except Exception as e:  # a full disk, a size limit, a rotation that failed
            if self.unavailable is None:
                log.error("the request log cannot be written, refusing new requests: %s", e)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            self.unavailable = (
                f"the request log cannot be written ({reason}); this server admits no "
                "request until it is restarted with a writable one"
            )

    def abort(self, request_id: str, error: str | None = None) -> list[RequestOutput]:
        """Ends a request and frees its pages, except pages a transfer may still touch
        (engine/remote_kv.py frees those): ABORTED (its client left), or FAILED with `error`
        where the engine failed it."""
        if request_id in self.remote.parked:
            return []
        state = RequestState.ABORTED if error is None else RequestState.FAILED
        outputs = []
        for req in self.requests.pop(request_id, []):
            if not req.is_terminal:
                self.finish(req, state, error)
                outputs.append(self._output(req))
        return outputs

    # --- the step --------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        self.remote.expire_parked()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.monotonic()
        for req, _ in batch:
            req.first_scheduled_time = req.first_scheduled_time or now
        batch, violations = self.runner.check(batch)
        outputs = []
        for req, problem in violations:
            self.finish(
                req,
                RequestState.FAILED,
                f"internal error: KV ownership check failed ({problem})",
            )
            outputs.append(self._output(req))
        if not batch:
            return outputs
        logits, sampled = self.runner.run(batch)
        for req, n in batch:
            self._advance(req, n)
            if req.prefill_only and req.num_computed_tokens == req.num_tokens:
                self.scheduler.remove(req)
                self.remote.park(req)
                outputs.append(self._output(req))
        for req, result in zip(sampled, sample_isolating_errors(logits, sampled, self.generator)):
            try:
                if isinstance(result, Exception):
                    raise result
                self._add_token(req, *result)
            except Exception as error:  # one request's failure ends that request, not the step
                log.error(
                    "request %s (tenant %s) failed while sampling or handling its token",
                    req.request_id,
                    req.tenant,
                    exc_info=error,
                )
                if not req.is_terminal:
                    error = (
                        str(error)  # the client's own grammar: it may know why
                        if isinstance(error, GrammarError)
                        else "internal error while sampling this request"
                    )
                    self.finish(req, RequestState.FAILED, error)
            outputs.append(self._output(req))
        return outputs

    def _advance(self, req: Request, n: int) -> None:
        """Counts the `n` tokens a step computed; a prompt computed in full is offered to the
        prefix cache."""
        n_prompt = len(req.prompt_token_ids)
        if req.num_computed_tokens < n_prompt:
            req.num_prompt_tokens_computed += min(n, n_prompt - req.num_computed_tokens)
            if self.prefix_cache and req.num_computed_tokens + n >= n_prompt:
                req.num_shared_pages = self.prefix_cache.insert(
                    req.tenant,
                    req.owner,
                    req.prompt_token_ids,
                    req.block_table,
                    req.num_shared_pages,
                )
        req.num_computed_tokens += n

    def _add_token(self, req: Request, token: int, logprob: dict | None) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            self.stats["prompt_tokens"] += len(req.prompt_token_ids)
        self.stats["generation_tokens"] += 1
        final = append_token(req, token, logprob, self.eos_token_ids)
        if final is not None:
            self.finish(req, final)

    def _output(self, req: Request) -> RequestOutput:
        out = take_output(req, parked=req.parent_id in self.remote.parked)
        if out.finished and all(r.is_terminal for r in self.requests.get(req.parent_id, [])):
            self.requests.pop(req.parent_id, None)
        return out
