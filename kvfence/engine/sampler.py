"""Turns logits into the next token of each request: logit bias, penalties, temperature,
top-k, top-p, min-p, seeded sampling, and log-probabilities of the raw model distribution."""

import torch

from kvfence.engine.request import Request
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.structured import mask_logits
from kvfence.model.kernels import fused_ops


def adjusts_logits(req: Request) -> bool:
    p = req.params
    return bool(
        p.logit_bias
        or p.repetition_penalty != 1.0
        or ((p.presence_penalty or p.frequency_penalty) and req.output_token_ids)
    )


def adjust_logits(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """logit_bias, then the repetition penalty over prompt and output (as in Hugging Face
    and vLLM: positive logits divided, negative ones multiplied), then the OpenAI
    presence and frequency penalties over the output."""
    p = req.params
    if not adjusts_logits(req):
        return logits
    if p.logit_bias:
        ids, values = logit_bias_tensors(p, logits)
        logits = logits.index_add(0, ids, values)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(req.all_token_ids, device=logits.device).unique()
        old = logits[seen]
        logits = logits.index_copy(
            0,
            seen,
            torch.where(old > 0, old / p.repetition_penalty, old * p.repetition_penalty),
        )
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(
            torch.tensor(req.output_token_ids, device=logits.device),
            minlength=logits.shape[-1],
        ).to(logits.dtype)
        logits = (
            logits
            - p.frequency_penalty * counts
            - p.presence_penalty * (counts > 0).to(logits.dtype)
        )
    return logits


def logit_bias_tensors(p: SamplingParams, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The request's logit_bias as (token ids, values), built on its first step only."""
    cached = p.logit_bias_tensors
    if cached is None or cached[1].dtype != logits.dtype or cached[1].device != logits.device:
        on = dict(device=logits.device)
        cached = (
            torch.tensor(list(p.logit_bias), **on),
            torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, **on),
        )
        p.logit_bias_tensors = cached
    return cached


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (its first maximum), through the CPU kernel where there is one, which
    vectorizes what torch.argmax does in scalar code."""
    ops = fused_ops(logits.device.type)
    return (logits.argmax(dim=-1) if ops is None else ops.argmax_rows(logits.contiguous())).tolist()


CHUNK = 256  # tokens per chunk when drawing: the mass of each chunk, then a walk within one


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token where the cumulative mass passes u x the row's mass (u in [0, 1)):
    chunk masses first, then a cumulative sum inside one chunk, so the row is read once
    instead of being summed token after token. The token picked always has mass."""
    rows, vocab = probs.shape
    if vocab % CHUNK:
        probs = torch.nn.functional.pad(probs, (0, -vocab % CHUNK))
    chunks = probs.view(rows, -1, CHUNK)
    cdf = chunks.sum(-1).cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    chunk = torch.searchsorted(cdf, target, right=True)
    before = torch.where(
        chunk > 0, cdf.gather(1, (chunk - 1).clamp(min=0)), torch.zeros_like(total)
    )
    inside = chunks[torch.arange(rows, device=probs.device), chunk[:, 0]].cumsum(-1)
    rest = torch.minimum(target - before, torch.nextafter(inside[:, -1:], torch.zeros_like(total)))
    return chunk[:, 0] * CHUNK + torch.searchsorted(inside, rest, right=True)[:, 0]


def rows_of(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return t if rows == list(range(len(t))) else t[rows]  # indexing copies: skip it for all rows


def sample_rows(
    logits: torch.Tensor, requests: list[Request], generator: torch.Generator
) -> list[int]:
    """Samples one token per row of `logits`: temperature, top-k, top-p over what top-k
    keeps, then min-p. Each draw takes one uniform number from the request's own generator
    (seeded ones) or the engine's, and every step is row by row, so a seeded request draws
    the same tokens in any batch.

    Top-p without sorting the vocabulary: a token is in the nucleus when the tokens more
    likely than it hold less than top_p of the mass. Draw from the whole distribution and
    keep the token if it is in; if not, neither is any token as unlikely, so drop those
    and draw again (rejection sampling: the kept draws follow the nucleus exactly)."""
    params = [req.params for req in requests]
    on = dict(dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(
        logits / torch.tensor([p.temperature for p in params], **on)[:, None], dim=-1
    )
    top_k = [j for j, p in enumerate(params) if 0 < p.top_k < probs.shape[-1]]
    if top_k:
        ks = torch.tensor([params[j].top_k for j in top_k], device=logits.device)
        floor = torch.zeros(len(params), **on)
        floor[top_k] = torch.topk(rows_of(probs, top_k), int(ks.max())).values.gather(
            1, (ks - 1)[:, None]
        )[:, 0]
        probs.masked_fill_(probs < floor[:, None], 0.0)
    nucleus = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        limit = torch.tensor([params[j].top_p for j in nucleus], **on) * rows_of(
            probs, nucleus
        ).sum(-1)
    # min-p once the nucleus's mass is known: it drops only tokens less likely than any it
    # keeps, so the nucleus test of a drawn token sees the same mass above it
    if any(p.min_p > 0.0 for p in params):
        floor = torch.tensor([p.min_p for p in params], **on) * probs.max(dim=-1).values
        probs.masked_fill_(probs < floor[:, None], 0.0)

    def uniforms(rows) -> torch.Tensor:
        return torch.stack(
            [torch.rand((), generator=requests[j].generator or generator) for j in rows]
        ).to(**on)

    tokens = draw(probs, uniforms(range(len(params))))
    # The rows whose last draw is not yet known to be in.
    pending, rows = nucleus, rows_of(probs, nucleus)
    while pending:
        drawn = rows.gather(1, tokens[pending][:, None])
        outside = torch.where(rows > drawn, rows, 0.0).sum(-1) >= limit
        pending = [j for j, out in zip(pending, outside.tolist()) if out]
        if pending:
            # Copies: probs stays as it was.
            rows, drawn, limit = rows[outside], drawn[outside], limit[outside]
            tokens[pending] = draw(rows.masked_fill_(rows <= drawn, 0.0), uniforms(pending))
    return tokens.tolist()


def sample(
    logits: torch.Tensor, requests: list[Request], generator: torch.Generator
) -> list[tuple[int, dict | None]]:
    """Returns (token id, logprobs entry or None) per request. A structured output's row is
    masked to what its grammar allows first: its own row only."""
    constrained = [i for i, req in enumerate(requests) if req.matcher is not None]
    if constrained:
        mask_logits(logits, constrained, [requests[i].matcher for i in constrained])
    adjusted = [adjusts_logits(req) for req in requests]
    plain = [req.params.greedy and not adj for req, adj in zip(requests, adjusted)]
    # One argmax over the whole batch instead of one per row: most requests are greedy.
    tokens = greedy_tokens(logits) if any(plain) else [None] * len(requests)
    drawn = []
    for i, req in enumerate(requests):
        if req.params.greedy and not plain[i]:  # greedy with a bias or penalties
            tokens[i] = int(torch.argmax(adjust_logits(logits[i], req)))
        elif not req.params.greedy:
            drawn.append(i)
    if drawn:
        if any(adjusted[i] for i in drawn):
            rows = torch.stack([adjust_logits(logits[i], requests[i]) for i in drawn])
        else:
            rows = rows_of(logits, drawn)
        for i, token in zip(drawn, sample_rows(rows, [requests[i] for i in drawn], generator)):
            tokens[i] = token
    results = [(token, None) for token in tokens]
    wanted = [i for i, req in enumerate(requests) if req.params.logprobs is not None]
    if wanted:
        logprobs = torch.log_softmax(rows_of(logits, wanted), dim=-1)
        for row, i in zip(logprobs, wanted):
            k = requests[i].params.logprobs
            top = torch.topk(row, k) if k else None
            results[i] = (
                tokens[i],
                {
                    "token_id": tokens[i],
                    "logprob": float(row[tokens[i]]),
                    "top": []
                    if top is None
                    else [(int(t), float(v)) for v, t in zip(top.values, top.indices)],
                },
            )
    return results


Sampled = tuple[int, dict | None]  # a token id and its logprobs entry (or None)


def sample_isolating_errors(
    logits: torch.Tensor, requests: list[Request], generator: torch.Generator
) -> list[Sampled | Exception]:
    """sample() over the whole batch; if that raises, each request again on its own, so an
    error one request's row or parameters cause comes back in that request's place and the
    others still get their token. (After such a failure a seeded row draws from where its
    generator stands, not from where it stood before the batch.)"""
    try:
        return sample(logits, requests, generator)
    except Exception:  # which row failed is not known: the rows that fail alone tell
        return [sample_alone(logits[i : i + 1], req, generator) for i, req in enumerate(requests)]


def sample_alone(
    logits: torch.Tensor, req: Request, generator: torch.Generator
) -> Sampled | Exception:
    try:
        return sample(logits, [req], generator)[0]
    except Exception as error:  # returned, not raised: the engine fails this request only
        return error
