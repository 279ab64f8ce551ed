"""What the engine reports about a request after a step."""
from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """The delta_* fields are what is new since the request's previous output. The whole
    completion (token_ids, text, logprobs) is carried by the final output only, so that a
    long stream does not copy its growing token list at every step."""
    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] | None  # None until finished
    text: str | None             # None until finished
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None  # None until finished
    delta_logprobs: list[dict] = field(default_factory=list)
    error: str | None = None
    num_cached_tokens: int = 0
    parked: bool = False  # prefill-only request whose KV is ready to be transferred


def merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`later` carrying the deltas of `earlier` too, for a reader that did not take `earlier`
    (whose lists it takes over)."""
    earlier.delta_token_ids.extend(later.delta_token_ids)
    earlier.delta_logprobs.extend(later.delta_logprobs)
    later.delta_token_ids, later.delta_logprobs = earlier.delta_token_ids, earlier.delta_logprobs
    later.delta_text = earlier.delta_text + later.delta_text
    return later
