"""What the engine reports about a request after a step."""
from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict] = field(default_factory=list)
    error: str | None = None
    num_cached_tokens: int = 0
    parked: bool = False  # prefill-only request whose KV is ready to be transferred
