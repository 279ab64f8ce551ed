"""A request and its state machine.

WAITING -> RUNNING <-> PREEMPTED, then exactly one terminal state. Code that decides
whether a request may still be scheduled, computed or transferred asks `is_terminal`,
never whether it is in one particular state: that confusion is what turned rejected
requests into live ones in the 2026 incident.
"""

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from kvfence.engine.sampling_params import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOP = "stop"
    FINISHED_LENGTH = "length"
    ABORTED = "abort"
    REJECTED = "rejected"
    FAILED = "error"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {
        RequestState.FINISHED_STOP,
        RequestState.FINISHED_LENGTH,
        RequestState.ABORTED,
        RequestState.REJECTED,
        RequestState.FAILED,
    }
)

_owner_ids = itertools.count(1)


@dataclass(eq=False)  # identity, not field equality: two requests are never the same
class Request:
    request_id: str
    prompt_token_ids: list[int]
    parent_id: str
    index: int
    params: SamplingParams
    max_tokens: int
    tenant: str = "default"
    owner: int = field(default_factory=lambda: next(_owner_ids))
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    page_generations: list[int] = field(default_factory=list)
    num_shared_pages: int = 0  # leading block-table pages borrowed from the prefix cache
    num_cached_tokens: int = 0
    prefix_checked: bool = False  # looked up in the prefix cache since last (re)admission
    prefill_only: bool = False  # disaggregated prefill: compute the KV, never sample
    lease_s: float = 0.0  # prefill-only: how long its KV stays parked for the decode side
    logprobs: list[dict] = field(default_factory=list)
    generator: torch.Generator | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0
    detokenizer: object | None = None
    matcher: object | None = None  # its place in a structured output's grammar, if it has one
    text: str = ""
    sent_text_len: int = 0
    sent_token_len: int = 0
    stop_reason: str | int | None = None
    sentinel_violation: str | None = None  # the first ownership problem the sentinel saw, if any

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def set_state(self, state: RequestState) -> None:
        if self.state.is_terminal:
            raise RuntimeError(
                f"request {self.request_id} is already {self.state.value}, "
                f"cannot become {state.value}"
            )
        self.state = state
        if state.is_terminal:
            self.finish_time = time.monotonic()

    @property
    def finish_reason(self) -> str | None:
        return self.state.value if self.state.is_terminal else None
