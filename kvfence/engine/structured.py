"""Structured outputs: a request's answer held to a JSON schema, a regular expression, a list
of choices or a grammar, by masking every token that would leave it (llguidance).

Compiling is the expensive part and runs where the caller chooses (the server: off the
engine thread, under a time budget); each sequence then steps a copy of the compiled matcher.
"""

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

from kvfence.engine.sampling_params import MAX_CHOICES, InvalidRequest, StructuredOutputs

# The JSON an answer may hold: fixed separators and no free whitespace, so that a model
# cannot fill max_tokens with spaces and newlines. Overrides win over a schema's x-guidance.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Past 64 KiB, schemas of many optional properties take seconds to compile (the cost grows
# with their square); tool lists and real schemas are far smaller.
MAX_SPEC_CHARS = 64 * 1024
CACHE_PER_TENANT = 32  # compiled grammars kept per tenant
# llguidance's budgets: regex work while compiling (a quarter of its default, which let one
# counted-repetition regex take 0.75 s and 200 MB), lexer states (1-2 kB each), and the work
# of one step's mask (a fifth of its defaults: an ambiguous grammar's Earley items grow with
# the answer, and at the default a mask took 44 ms of the engine thread).
LIMITS = dict(
    initial_lexer_fuel=250_000,
    max_lexer_states=50_000,
    step_max_items=10_000,
    step_lexer_fuel=40_000,
)
# Time a request's masks may take on the engine thread, which every tenant shares: so much at
# first, then so much a token on average. Past it, that request fails.
MASK_BUDGET_S = 0.05
MASK_BUDGET_PER_TOKEN_S = 0.002
# Long rule or $ref chains recurse deeply in llguidance's compiler, past a thread's usual
# 8 MiB stack (a crash of the whole process): compiling gets a thread with a larger one, which
# only reserves address space.
COMPILE_STACK_BYTES = 256 * 2**20


def llguidance_grammar(spec: StructuredOutputs) -> str:
    """The constraint in llguidance's grammar format; InvalidRequest if it is not one."""
    kind, text = spec.kind(), spec.text()
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(
            f"{spec.param} is {len(text)} characters; the limit is {MAX_SPEC_CHARS}", spec.param
        )
    try:
        if kind == "choice":
            choice = spec.choice
            if not (0 < len(choice) <= MAX_CHOICES and all(isinstance(c, str) for c in choice)):
                raise ValueError(f"choice must be 1 to {MAX_CHOICES} strings")
            return llguidance.grammar_from("choice", choice)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", text)
        schema = '{"type":"object"}' if kind == "json_object" else text
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError, RecursionError) as e:
        raise InvalidRequest(f"{spec.param}: {_short(str(e))}", spec.param) from None


class Grammars:
    """Compiles constraints for one tokenizer, and keeps each tenant's recent ones: a cache
    shared between tenants would tell one, by how fast a compile returns, which schemas
    another has used."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None  # built on first use: about a second for a large vocabulary
        self._lock = threading.Lock()
        self._cache: dict[str, OrderedDict] = {}
        self.compiles = 0  # grammars compiled (not served from a cache)

    def tokenizer(self) -> "llguidance.LLTokenizer":
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def compile(self, spec: StructuredOutputs, tenant: str) -> "Grammar":
        key = spec.kind() + "\0" + spec.text()
        with self._lock:
            cached = self._cache.setdefault(tenant, OrderedDict())
            if key in cached:
                cached.move_to_end(key)
                return cached[key]
        grammar = Grammar(self._build(spec), spec)
        with self._lock:
            cached[key] = grammar
            if len(cached) > CACHE_PER_TENANT:
                cached.popitem(last=False)
        return grammar

    def _build(self, spec: StructuredOutputs) -> "llguidance.LLMatcher":
        grammar, tokenizer = llguidance_grammar(spec), self.tokenizer()
        limits = llguidance.LLParserLimits(**LIMITS, verbose_errors=False)
        built = {}

        def build() -> None:  # llguidance drops the GIL while it compiles
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
            if not matcher.is_error():
                matcher.compute_bitmask()  # some grammars fail only at their first mask
            built["matcher"] = matcher

        with _stack_lock:
            threading.stack_size(COMPILE_STACK_BYTES)
            try:
                thread = threading.Thread(target=build, name="grammar-compile")
                thread.start()
            finally:
                threading.stack_size(0)
        thread.join()
        matcher = built["matcher"]
        if matcher.is_error():
            raise InvalidRequest(f"{spec.param}: {_short(matcher.get_error())}", spec.param)
        self.compiles += 1
        return matcher

    def attach(self, params, tenant: str) -> None:
        """Compiles the params' constraint unless it already is (the server compiles ahead)."""
        spec = params.structured_outputs
        if spec is not None and (params.grammar is None or params.grammar.spec != spec):
            params.grammar = self.compile(spec, tenant)


_stack_lock = threading.Lock()  # threading.stack_size is process-wide: set it for ours only


def _short(error: str) -> str:
    return error if len(error) <= 400 else error[:400] + "..."


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: never stepped itself, each sequence steps a copy."""

    matcher: "llguidance.LLMatcher"
    spec: StructuredOutputs

    def start(self) -> "Matcher":
        return Matcher(self.matcher.deep_copy())


class GrammarError(RuntimeError):
    """A request's grammar cannot go on (over its budgets, or a token it refused): that request
    fails, with this message."""


class Matcher:
    """One sequence's place in its grammar, and the time its masks have taken."""

    def __init__(self, matcher: "llguidance.LLMatcher"):
        self.matcher = matcher
        self.mask_s = 0.0
        self.masks = 0

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def fill_mask(self, address: int, size: int) -> None:
        start = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(address, size)
        self.mask_s += time.perf_counter() - start
        self.masks += 1
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {_short(self.matcher.get_error())}")
        budget = MASK_BUDGET_S + MASK_BUDGET_PER_TOKEN_S * self.masks
        if self.mask_s > budget:
            raise GrammarError(
                f"the grammar's masks took {1e3 * self.mask_s:.0f} ms over {self.masks} tokens, "
                f"past the {1e3 * budget:.0f} ms they may take: make it less ambiguous"
            )

    @property
    def done(self) -> bool:
        """Nothing but the end of the answer may follow."""
        return self.matcher.is_stopped()


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
    """Sets to -inf, in these rows of `logits` only, every token their grammar forbids. Each
    mask is computed on this thread, outside the GIL: a pool of threads of its own would
    contend with the model's OpenMP threads, which are still spinning for the next step."""
    width = logits.shape[-1]
    bitmask = np.empty((len(rows), (width + 31) // 32), dtype=np.int32)
    for i, m in enumerate(matchers):
        m.fill_mask(bitmask[i].ctypes.data, bitmask.shape[1] * 4)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :width]
    forbidden = torch.from_numpy(allowed == 0).to(logits.device)
    with torch.inference_mode():  # the model's logits are inference tensors
        for i, row in enumerate(rows):
            logits[row].masked_fill_(forbidden[i], float("-inf"))
