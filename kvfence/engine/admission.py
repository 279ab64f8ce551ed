"""Admission: every request is checked before anything is allocated for it, and only then
becomes the Requests the scheduler runs."""

import torch

from kvfence.engine.request import Request
from kvfence.engine.sampling_params import InvalidRequest, SamplingParams
from kvfence.engine.structured import Grammars
from kvfence.kv.allocator import PageAllocator
from kvfence.model.tokenizer import IncrementalDetokenizer


class Admission:
    def __init__(
        self,
        allocator: PageAllocator,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        grammars: Grammars | None = None,
    ):
        self.allocator = allocator  # for the pool's size and page arithmetic
        self.tokenizer = tokenizer  # each sequence's detokenizer
        self.grammars = grammars  # compiles structured outputs the caller did not compile
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.rejected: dict[str, int] = {}  # refusals by reason, for the metrics

    @classmethod
    def of(cls, engine) -> "Admission":
        """The admission of an engine: what it reads of it, taken once."""
        vocab = engine.model_config.vocab_size
        return cls(engine.allocator, engine.tokenizer, vocab, engine.max_model_len, engine.grammars)

    def check(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        kv_tokens: int | None = None,
    ) -> int:
        """Returns the request's max_tokens. `kv_tokens` is what this worker must hold (a
        prefill worker holds only the prompt). Raises InvalidRequest with a reason the
        caller can act on."""
        try:
            return self._check(prompt_ids, params, kv_tokens)
        except InvalidRequest as e:
            self.rejected[e.code] = self.rejected.get(e.code, 0) + 1
            raise

    def _check(self, prompt_ids: list[int], params: SamplingParams, kv_tokens: int | None) -> int:
        vocab, allocator = self.vocab_size, self.allocator
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        params.validate(vocab)
        n_prompt, limit = len(prompt_ids), self.max_model_len
        if n_prompt >= limit:
            raise InvalidRequest(
                f"the prompt has {n_prompt} tokens; this model's maximum context length is "
                f"{limit} tokens, which must also leave room for at least one output token",
                "prompt",
                "context_length_exceeded",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n_prompt
        if n_prompt + max_tokens > limit:
            raise InvalidRequest(
                f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) is "
                f"{n_prompt + max_tokens}, over this model's maximum context length of {limit} "
                f"tokens; lower max_tokens to at most {limit - n_prompt}",
                "max_tokens",
                "context_length_exceeded",
            )
        pages = allocator.pages_for(n_prompt + max_tokens if kv_tokens is None else kv_tokens)
        if pages > allocator.num_pages:
            raise InvalidRequest(
                f"the request needs {pages} KV pages and the whole pool has {allocator.num_pages}",
                "max_tokens",
                "kv_pool_exceeded",
            )
        return max_tokens

    def requests(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
    ) -> list[Request]:
        """The n sequences of an admitted request, ready to be queued."""
        max_tokens = self.check(prompt_ids, params)
        self.compile(params, tenant)
        return [
            self.sequence(prompt_ids, params, request_id, tenant, max_tokens, i)
            for i in range(params.n)
        ]

    def prefill_only(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
    ) -> Request:
        """A disaggregated prefill: the KV of every prompt token but the last, never sampled
        (the decode worker computes the last token)."""
        self.check(prompt_ids, params, kv_tokens=len(prompt_ids))
        return Request(
            request_id=f"{request_id}-0",
            prompt_token_ids=prompt_ids[:-1],
            parent_id=request_id,
            index=0,
            params=params,
            max_tokens=0,
            tenant=tenant,
            prefill_only=True,
        )

    def remote(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
    ) -> Request:
        """A request whose prompt KV arrives from a prefill worker: never looked up in this
        worker's prefix cache."""
        max_tokens = self.check(prompt_ids, params)
        self.compile(params, tenant)
        req = self.sequence(prompt_ids, params, request_id, tenant, max_tokens)
        req.prefix_checked = True
        return req

    def compile(self, params: SamplingParams, tenant: str) -> None:
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise InvalidRequest(
                    "this engine serves no structured outputs", "structured_outputs"
                )
            self.grammars.attach(params, tenant)

    def sequence(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
        max_tokens: int,
        index: int = 0,
    ) -> Request:
        req = Request(
            request_id=f"{request_id}-{index}",
            prompt_token_ids=prompt_ids,
            parent_id=request_id,
            index=index,
            params=params,
            max_tokens=max_tokens,
            tenant=tenant,
        )
        if params.seed is not None:  # each of n sequences draws its own stream
            req.generator = torch.Generator().manual_seed(params.seed + index)
        if params.grammar is not None:
            req.matcher = params.grammar.start()
        req.detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.skip_special_tokens
        )
        return req
