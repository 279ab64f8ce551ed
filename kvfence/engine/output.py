"""What a request produces: its tokens, stop checks, the deltas it reports and its log line."""

from dataclasses import dataclass, field

from kvfence.engine.request import Request, RequestState


@dataclass
class RequestOutput:
    """The delta_* fields are what is new since the request's previous output. The whole
    completion (token_ids, text, logprobs) is carried by the final output only, so that a
    long stream does not copy its growing token list at every step."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] | None  # None until finished
    text: str | None  # None until finished
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
    later.delta_token_ids, later.delta_logprobs = (
        earlier.delta_token_ids,
        earlier.delta_logprobs,
    )
    later.delta_text = earlier.delta_text + later.delta_text
    return later


def append_token(
    req: Request, token: int, logprob: dict | None, eos_token_ids: set[int]
) -> RequestState | None:
    """Adds a sampled token to the request; returns the state it ends in, or None while it
    goes on. The caller finishes the request."""
    req.output_token_ids.append(token)
    if logprob is not None:
        req.logprobs.append(logprob)
    req.text += req.detokenizer.add(token)
    if req.matcher is not None:
        req.matcher.accept(token)
    p = req.params
    if token in p.stop_token_ids or (token in eos_token_ids and not p.ignore_eos):
        req.stop_reason = token if token in p.stop_token_ids else None
        return RequestState.FINISHED_STOP
    if hit_stop_string(req):
        return RequestState.FINISHED_STOP
    if req.matcher is not None and req.matcher.done:  # the grammar allows nothing more
        return RequestState.FINISHED_STOP
    if len(req.output_token_ids) >= req.max_tokens:
        return RequestState.FINISHED_LENGTH
    return None


def hit_stop_string(req: Request) -> bool:
    """Cuts the text at the first stop string in its tail, if one has formed."""
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


def take_output(req: Request, parked: bool = False) -> RequestOutput:
    """Reports what is new since the last output, and the whole completion once it is
    finished. While a stop string could still be forming, the text that might belong to it
    is held back."""
    stop = req.params.stop
    hold = 0 if req.is_terminal or not stop else max(len(s) for s in stop) - 1
    end = max(req.sent_text_len, len(req.text) - hold)
    delta = req.text[req.sent_text_len : end]
    req.sent_text_len = end
    sent_tokens, req.sent_token_len = req.sent_token_len, len(req.output_token_ids)
    finished = req.is_terminal
    return RequestOutput(
        request_id=req.parent_id,
        index=req.index,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids) if finished else None,
        text=req.text if finished else None,
        delta_text=delta,
        delta_token_ids=req.output_token_ids[sent_tokens:],
        finished=finished,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        logprobs=list(req.logprobs) if finished else None,
        delta_logprobs=req.logprobs[sent_tokens:],
        error=req.error,
        num_cached_tokens=req.num_cached_tokens,
        parked=parked,
    )


def finish_record(req: Request) -> dict:
    """The request log's line for a finished request: counts and times, never its text."""
    t0 = req.arrival_time

    def ms(t: float | None) -> float | None:
        return None if t is None else round((t - t0) * 1000, 1)

    return {
        "event": "request_finished",
        "request_id": req.request_id,
        "tenant": req.tenant,
        "prompt_tokens": len(req.prompt_token_ids),
        "prompt_tokens_computed": req.num_prompt_tokens_computed,
        "cached_tokens": req.num_cached_tokens,
        "output_tokens": len(req.output_token_ids),
        "queue_ms": ms(req.first_scheduled_time),
        "ttft_ms": ms(req.first_token_time),
        "total_ms": ms(req.finish_time),
        "finish_reason": req.finish_reason,
        "preemptions": req.num_preemptions,
        "error": req.error,
    }
