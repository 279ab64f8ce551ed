"""Per-request sampling parameters and their validation (part of admission)."""

import json
from dataclasses import dataclass, field

from kvfence.options import option

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
MAX_CHOICES = 1000  # strings of a structured output's choice
# Temperatures under it are greedy, as in vLLM: dividing logits by them overflows.
GREEDY_BELOW = 1e-5
FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number
TINY = f"{FLOAT32_TINY:.3g}"  # as error messages show it


def fits_float32(x: float) -> bool:
    """Zero, or a value float32 (the sampler's arithmetic) holds as a normal number: a smaller
    one flushes to zero or loses its precision, so top_p=1e-46 would keep no token at all."""
    return x == 0.0 or FLOAT32_TINY <= abs(x)


class InvalidRequest(ValueError):
    """A request that cannot be served; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class StructuredOutputs:
    """What the answer must be: exactly one of json (a JSON schema), json_object (any JSON
    object), regex, choice (one of these strings) or grammar (EBNF as llama.cpp writes it, or
    Lark). `param` is the request field that errors name."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str = field(default="structured_outputs", compare=False)

    def kind(self) -> str:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequest(
                f"{self.param} takes exactly one of json, json_object, regex, choice or "
                f"grammar; got {', '.join(given) or 'none'}",
                self.param,
            )
        return given[0]

    def text(self) -> str:
        """The constraint as text: a schema or choice list as compact JSON (in its own key
        order, which is the order the answer's properties take)."""
        value = {"json_object": True}.get(self.kind(), getattr(self, self.kind()))
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


@dataclass
class SamplingParams:
    n: int = 1
    # The fields declared with option() are also `kvfence generate`'s flags.
    max_tokens: int | None = option(16, "most tokens to generate")
    temperature: float = option(1.0, f"randomness of sampling; under {GREEDY_BELOW} greedy")
    top_p: float = option(
        1.0, "sample from the most likely tokens whose probabilities add up to X (nucleus)"
    )
    top_k: int = option(-1, "sample from the N most likely tokens (-1: all)")
    seed: int | None = option(None, "seed of this prompt's sampling", flag="--sampling-seed")
    stop: list[str] = option([], "a string that ends the output (repeat for several)")
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    # the compiled constraint (kvfence.engine.structured.Grammar), attached at admission
    grammar: object | None = field(default=None, init=False, repr=False, compare=False)
    # logit_bias as (token ids, values) tensors, built once by the sampler instead of every step
    logit_bias_tensors: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequest(message, param)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.structured_outputs is not None:
            self.structured_outputs.kind()
        check(
            isinstance(self.n, int) and 1 <= self.n <= MAX_N,
            "n",
            f"n must be an integer in [1, {MAX_N}]",
        )
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "max_tokens must be a positive integer",
        )
        check(
            0.0 <= self.temperature <= 2.0,
            "temperature",
            "temperature must be in [0, 2]",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
            "top_k",
            "top_k must be -1 (off), 0 (off) or a positive integer",
        )
        check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            "seed must be an integer in [0, 2**63)",
        )
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "presence_penalty must be in [-2, 2]",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "frequency_penalty must be in [-2, 2]",
        )
        # from 0.01: dividing a logit by less could overflow it
        check(
            0.01 <= self.repetition_penalty <= 2.0,
            "repetition_penalty",
            "repetition_penalty must be in [0.01, 2]",
        )
        check(0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
        for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty"):
            check(
                fits_float32(getattr(self, name)),
                name,
                f"{name} is too small for float32: if not 0, at least {TINY} in size",
            )
        check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens",
        )
        check(
            all(isinstance(t, int) and 0 <= t < vocab_size for t in self.logit_bias),
            "logit_bias",
            f"logit_bias keys must be token ids in [0, {vocab_size})",
        )
        check(
            all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()),
            "logit_bias",
            "logit_bias values must be in [-100, 100]",
        )
        check(
            all(fits_float32(b) for b in self.logit_bias.values()),
            "logit_bias",
            f"logit_bias values are too small for float32: if not 0, at least {TINY} in size",
        )
        check(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"logprobs must be an integer in [0, {MAX_LOGPROBS}]",
        )
        check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings",
        )
        check(
            all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"each stop string must be 1 to {MAX_STOP_STRING_CHARS} characters",
        )
        check(
            len(self.stop_token_ids) <= MAX_STOP_STRINGS,
            "stop_token_ids",
            f"at most {MAX_STOP_STRINGS} stop token ids",
        )
        check(
            all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids),
            "stop_token_ids",
            f"stop token ids must be in [0, {vocab_size})",
        )
