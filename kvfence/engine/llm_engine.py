"""The engine: admission, the step loop, sampling, stop handling and the free path."""
import json
import logging
import secrets
import time
import uuid

import torch

from kvfence import faults, openmp
from kvfence.config import KV_CACHE_DTYPES, EngineConfig
from kvfence.engine.decode_graphs import DecodeGraphs
from kvfence.engine.model_runner import ModelRunner
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import Request, RequestState
from kvfence.engine.request_log import RequestLog, audit_record
from kvfence.engine.sampler import sample_isolating_errors
from kvfence.engine.sampling_params import InvalidRequest, SamplingParams
from kvfence.engine.scheduler import Scheduler
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.pool import KVPool
from kvfence.kv.prefix_cache import PrefixCache
from kvfence.model.kernels import decode_kernel, linear_kernel
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import has_gguf_blocks, load_model, resolve_model_path
from kvfence.model.tokenizer import IncrementalDetokenizer, load_tokenizer

log = logging.getLogger("kvfence.engine")
request_log = logging.getLogger("kvfence.requests")


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu" and not openmp.WAIT_CHOSEN:
            log.warning("torch was imported before kvfence, so OpenMP threads keep libgomp's default wait: "
                        "set GOMP_SPINCOUNT=300000 in the environment for up to 10-20% faster decoding")
        self.model_path = resolve_model_path(config.model)
        self.model_name = self.model_path.stem if self.model_path.is_file() else self.model_path.name
        blocks_run = (config.dtype in ("auto", "bfloat16") and config.device == "cpu"
                      and has_gguf_blocks(self.model_path) and linear_kernel("cpu") is not None)
        if config.dtype == "auto":  # gguf where it runs: the same results as float32 from a sixth to a third of the bytes
            config.dtype = "gguf" if blocks_run else "float32"
        # bf16 keeps the blocks too where they run, for the small batches that the kernel serves
        keep_blocks = config.dtype.startswith("gguf") or config.dtype == "bfloat16" and blocks_run
        model_config, weights = load_model(self.model_path, progress=progress, keep_blocks=keep_blocks)
        config.resolve(model_config)
        if config.inject_fault == faults.LEGACY_REJECT_PATH:
            faults.warn_at_start()
        elif config.inject_fault:
            faults.log.warning("!!! FAULT INJECTED: %s. NEVER run this outside tests. !!!", config.inject_fault)
        self.model_config = model_config
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = set(model_config.eos_token_ids) or {t for t in [self.tokenizer.eos_token_id] if t is not None}
        self.max_model_len = config.max_model_len
        self.pool = KVPool(model_config, config.num_kv_pages, config.page_size, config.device,
                           KV_CACHE_DTYPES[config.kv_cache_dtype])
        self.allocator = PageAllocator(config.num_kv_pages, config.page_size)
        self.prefix_cache = PrefixCache(self.allocator, self._scrub) if config.prefix_cache else None
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens, self.release,
                                   self.prefix_cache, fair=config.scheduling == "fair")
        model = LlamaModel(model_config, weights, config.device,
                           torch.bfloat16 if config.dtype == "bfloat16" else torch.float32,
                           int8_activations=config.dtype == "gguf-int8")
        kernel = decode_kernel(config.attention, config.device)
        graphs = None
        if config.device != "cpu" and not config.enforce_eager:
            graphs = DecodeGraphs(model, self.pool, config.max_num_seqs, -(-config.max_model_len // config.page_size))
        self.runner = ModelRunner(model, self.pool, self.allocator, config.kv_sentinel, kernel, graphs)
        # Unseeded requests draw from it: seeded from the OS, so that no two engines sample
        # alike, unless a seed is configured (reproducible benchmarks).
        seed = secrets.randbits(64) if config.seed is None else config.seed
        self.generator = torch.Generator().manual_seed(seed)
        self.requests: dict[str, list[Request]] = {}
        self.parked: dict[str, Request] = {}     # prefilled, pages held for a decode worker to pull
        self.receiving: dict[str, Request] = {}  # pages reserved for KV arriving from a prefill worker
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "aborted": 0, "failed": 0}
        self.rejected: dict[str, int] = {}
        self.request_log = RequestLog(config.request_log, int(config.request_log_max_mb * 2**20)) \
            if config.request_log else None
        self.on_finish: list = []  # called with each finished request's record (server metrics)

    def describe(self) -> str:
        """One line on what this engine runs, for the start-up log."""
        c = self.config
        return (f"{self.model_name}: dtype {c.dtype}, KV pool {c.kv_cache_dtype} {c.num_kv_pages} pages x "
                f"{c.page_size} tokens ({self.pool.capacity_tokens} tokens), max_model_len {c.max_model_len}, "
                f"max_num_seqs {c.max_num_seqs}, attention {'kernel' if self.runner.decode_kernel else 'torch'}, "
                f"sentinel {c.kv_sentinel}, scrub {c.kv_scrub}, prefix cache {'on' if c.prefix_cache else 'off'}, "
                f"{torch.get_num_threads()} threads on {c.device}")

    # --- admission ------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, kv_tokens: int | None = None) -> int:
        """Checks a request before anything is allocated; returns its max_tokens. `kv_tokens`
        is what this worker must hold (a prefill worker holds only the prompt).
        Raises InvalidRequest with a reason the caller can act on."""
        if faults.oversized(self, prompt_token_ids, params):
            return 1  # the injected fault lets it through to add_request
        try:
            return self._validate(prompt_token_ids, params, kv_tokens)
        except InvalidRequest as e:
            self.rejected[e.code] = self.rejected.get(e.code, 0) + 1
            raise

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams, kv_tokens: int | None) -> int:
        vocab = self.model_config.vocab_size
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        params.validate(vocab)
        n_prompt = len(prompt_token_ids)
        limit = self.max_model_len
        if n_prompt >= limit:
            raise InvalidRequest(
                f"the prompt has {n_prompt} tokens; this model's maximum context length is {limit} tokens, "
                f"which must also leave room for at least one output token", "prompt", "context_length_exceeded")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n_prompt
        if n_prompt + max_tokens > limit:
            raise InvalidRequest(
                f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) is {n_prompt + max_tokens}, over "
                f"this model's maximum context length of {limit} tokens; lower max_tokens to at most "
                f"{limit - n_prompt}", "max_tokens", "context_length_exceeded")
        pages = self.allocator.pages_for(n_prompt + max_tokens if kv_tokens is None else kv_tokens)
        if pages > self.allocator.num_pages:
            raise InvalidRequest(
                f"the request needs {pages} KV pages and the whole pool has {self.allocator.num_pages}",
                "max_tokens", "kv_pool_exceeded")
        return max_tokens

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, tenant: str = "default") -> list[Request]:
        params = params or SamplingParams()
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id} is already in use", "request_id")
        if faults.oversized(self, prompt_ids, params):
            req = faults.admit_placeholder(self, prompt_ids, params, request_id, tenant)
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens)
            self.requests[request_id] = [req]
            return [req]
        max_tokens = self.validate(prompt_ids, params)
        children = []
        for i in range(params.n):
            req = Request(request_id=f"{request_id}-{i}", prompt_token_ids=prompt_ids, parent_id=request_id,
                          index=i, params=params, max_tokens=max_tokens, tenant=tenant)
            if params.seed is not None:
                req.generator = torch.Generator().manual_seed(params.seed + i)
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            self.scheduler.add(req)
            children.append(req)
        self.requests[request_id] = children
        return children

    # --- the free path ----------------------------------------------------------------

    def release(self, req: Request) -> None:
        """Gives back every page a request holds. The only place pages are freed."""
        if self.prefix_cache:  # by the allocator's records of its references, not the block table
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
        return {"queried": c.queried_tokens if c else 0, "hits": c.hit_tokens if c else 0}

    def _finish(self, req: Request, state: RequestState, error: str | None = None) -> None:
        self.scheduler.remove(req)
        if req.parent_id not in self.receiving:  # pages under transfer wait for end_transfer
            self.release(req)
        req.error = error
        req.set_state(state)
        key = {RequestState.ABORTED: "aborted", RequestState.FAILED: "failed"}.get(state, "finished")
        self.stats[key] += 1
        self._log_finish(req)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Ends a request and frees its pages, except pages a transfer may still touch: a
        receiving request's are freed once its read has returned (end_transfer), and a parked
        request's stay until its reader is done or its lease ends (release_parked)."""
        if request_id in self.parked:
            return []
        outputs = []
        for req in self.requests.pop(request_id, []):
            if not req.is_terminal:
                self._finish(req, RequestState.ABORTED)
                outputs.append(self._output(req))
        return outputs

    # --- disaggregation: prefill-only requests, and KV received from a prefill worker ---

    def add_prefill_only(self, prompt_ids: list[int], params: SamplingParams, request_id: str, tenant: str,
                         park_timeout: float) -> Request:
        """Computes the KV of every prompt token but the last, then parks the request with its
        pages until the decode worker has pulled them (or `park_timeout` passes)."""
        if faults.oversized(self, prompt_ids, params):
            req = faults.admit_prefill_placeholder(self, prompt_ids, params, request_id, tenant)
        else:
            self.validate(prompt_ids, params, kv_tokens=len(prompt_ids))
            req = Request(request_id=f"{request_id}-0", prompt_token_ids=prompt_ids[:-1], parent_id=request_id,
                          index=0, params=params, max_tokens=0, tenant=tenant, prefill_only=True)
            self.scheduler.add(req)
        req.park_deadline = park_timeout
        self.requests[request_id] = [req]
        return req

    def release_parked(self, request_id: str) -> None:
        """The parked KV was pulled, or its lease ended: free its pages."""
        req = self.parked.pop(request_id, None)
        if req is not None and not req.is_terminal:
            self._finish(req, RequestState.FINISHED_STOP)
            self.requests.pop(request_id, None)

    def expire_parked(self) -> None:
        now = time.monotonic()
        for rid, req in list(self.parked.items()):
            if req.park_deadline < now:
                log.warning("request %s: no decode worker pulled its KV in time; freeing its pages", rid)
                self.release_parked(rid)

    def reserve_remote(self, prompt_ids: list[int], params: SamplingParams, request_id: str, tenant: str,
                       kv_tokens: int) -> Request:
        """Admits a request whose first `kv_tokens` prompt tokens arrive as KV from a prefill
        worker, and reserves pages for them. The request is not scheduled until activated."""
        max_tokens = self.validate(prompt_ids, params)
        needed = self.allocator.pages_for(kv_tokens)
        if self.prefix_cache and needed > self.allocator.num_free:
            self.prefix_cache.evict(needed - self.allocator.num_free)
        if needed > self.allocator.num_free:
            raise InvalidRequest(f"the decode pool has {self.allocator.num_free} free pages, {needed} are needed; "
                                 "retry shortly", "prompt", "kv_pool_busy")
        req = Request(request_id=f"{request_id}-0", prompt_token_ids=prompt_ids, parent_id=request_id, index=0,
                      params=params, max_tokens=max_tokens, tenant=tenant, prefix_checked=True)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        pages = self.allocator.allocate(req.owner, needed)
        req.block_table.extend(pages)
        req.page_generations.extend(int(self.allocator.generation[p]) for p in pages)
        self.requests[request_id] = [req]
        self.receiving[request_id] = req
        return req

    def end_transfer(self, request_id: str, received_tokens: int | None) -> None:
        """The read into a receiving request's pages has returned: nothing writes them any
        more. With the KV of `received_tokens` tokens (None: the transfer failed) the
        request decodes after exactly those; aborted or failed meanwhile, its pages are freed."""
        req = self.receiving.pop(request_id)
        if req.is_terminal:
            self.release(req)
        elif received_tokens is None:
            self._finish(req, RequestState.FAILED, "the KV transfer failed")
            self.requests.pop(request_id, None)
        else:
            self.runner.mark_written(req, 0, received_tokens)
            req.num_computed_tokens = received_tokens
            req.num_prompt_tokens_computed = 0
            self.scheduler.add(req)

    # --- the step --------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.monotonic()
        for req, _ in batch:
            req.first_scheduled_time = req.first_scheduled_time or now
        batch, violations = self.runner.check(batch)
        outputs = []
        for req, problem in violations:
            self._finish(req, RequestState.FAILED, f"internal error: KV ownership check failed ({problem})")
            outputs.append(self._output(req))
        if not batch:
            return outputs
        logits, sampled = self.runner.run(batch)
        for req, n in batch:
            n_prompt = len(req.prompt_token_ids)
            if req.num_computed_tokens < n_prompt:
                req.num_prompt_tokens_computed += min(n, n_prompt - req.num_computed_tokens)
                if self.prefix_cache and req.num_computed_tokens + n >= n_prompt:
                    req.num_shared_pages = self.prefix_cache.insert(
                        req.tenant, req.owner, req.prompt_token_ids, req.block_table, req.num_shared_pages)
            req.num_computed_tokens += n
            if req.prefill_only and req.num_computed_tokens == req.num_tokens:
                self.scheduler.remove(req)
                req.park_deadline += time.monotonic()
                self.parked[req.parent_id] = req
                outputs.append(self._output(req))
        for req, result in zip(sampled, sample_isolating_errors(logits, sampled, self.generator)):
            if isinstance(result, Exception):
                self._fail_alone(req, result)
            else:
                try:
                    self._append_token(req, *result)
                except Exception as error:  # one request's failure ends that request, not the step
                    self._fail_alone(req, error)
            outputs.append(self._output(req))
        return outputs

    def _fail_alone(self, req: Request, error: Exception) -> None:
        log.error("request %s (tenant %s) failed while sampling or handling its token",
                  req.request_id, req.tenant, exc_info=error)
        if not req.is_terminal:
            self._finish(req, RequestState.FAILED, "internal error while sampling this request")

    def _append_token(self, req: Request, token: int, logprob: dict | None) -> None:
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats["prompt_tokens"] += len(req.prompt_token_ids)
        self.stats["generation_tokens"] += 1
        req.output_token_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        req.text += req.detokenizer.add(token)
        p = req.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            req.stop_reason = token if token in p.stop_token_ids else None
            self._finish(req, RequestState.FINISHED_STOP)
        elif self._hit_stop_string(req):
            self._finish(req, RequestState.FINISHED_STOP)
        elif len(req.output_token_ids) >= req.max_tokens:
            self._finish(req, RequestState.FINISHED_LENGTH)

    @staticmethod
    def _hit_stop_string(req: Request) -> bool:
        if not req.params.stop:
            return False
        longest = max(len(s) for s in req.params.stop)
        window_start = max(0, len(req.text) - 2 * longest - 16)
        hits = [(req.text.find(s, window_start), s) for s in req.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        req.text = req.text[:index]
        req.stop_reason = stop
        return True

    def _output(self, req: Request) -> RequestOutput:
        """Reports what is new since the last output, and the whole completion once it is
        finished. While a stop string could still be forming, the text that might belong to
        it is held back."""
        hold = 0 if req.is_terminal or not req.params.stop else max(len(s) for s in req.params.stop) - 1
        end = max(req.sent_text_len, len(req.text) - hold)
        delta = req.text[req.sent_text_len:end]
        req.sent_text_len = end
        sent_tokens, req.sent_token_len = req.sent_token_len, len(req.output_token_ids)
        finished = req.is_terminal
        if finished and not any(not r.is_terminal for r in self.requests.get(req.parent_id, [])):
            self.requests.pop(req.parent_id, None)
        return RequestOutput(
            request_id=req.parent_id, index=req.index, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids) if finished else None,
            text=req.text if finished else None, delta_text=delta,
            delta_token_ids=req.output_token_ids[sent_tokens:], finished=finished,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if finished else None,
            delta_logprobs=req.logprobs[sent_tokens:], error=req.error,
            num_cached_tokens=req.num_cached_tokens, parked=req.parent_id in self.parked)

    def _log_finish(self, req: Request) -> None:
        t0 = req.arrival_time
        ms = lambda t: None if t is None else round((t - t0) * 1000, 1)  # noqa: E731
        record = {
            "event": "request_finished", "request_id": req.request_id, "tenant": req.tenant,
            "prompt_tokens": len(req.prompt_token_ids), "prompt_tokens_computed": req.num_prompt_tokens_computed,
            "cached_tokens": req.num_cached_tokens, "output_tokens": len(req.output_token_ids),
            "queue_ms": ms(req.first_scheduled_time), "ttft_ms": ms(req.first_token_time),
            "total_ms": ms(req.finish_time), "finish_reason": req.finish_reason,
            "preemptions": req.num_preemptions, "error": req.error,
        }
        request_log.info(json.dumps(record))
        for hook in self.on_finish:
            hook(record)
        if self.request_log is not None:
            self.request_log.write(audit_record(record, req, self.config.kv_sentinel))
