"""Turns logits into the next token of each request: logit bias, penalties, temperature,
top-k, top-p, min-p, seeded sampling, and log-probabilities of the raw model distribution."""
import torch

from kvfence.engine.request import Request
from kvfence.model.kernels import fused_ops


def adjusts_logits(req: Request) -> bool:
    p = req.params
    return bool(p.logit_bias or p.repetition_penalty != 1.0
                or ((p.presence_penalty or p.frequency_penalty) and req.output_token_ids))


def adjust_logits(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """logit_bias, then the repetition penalty over prompt and output (as in Hugging Face
    and vLLM: positive logits divided, negative ones multiplied), then the OpenAI
    presence and frequency penalties over the output."""
    p = req.params
    if not adjusts_logits(req):
        return logits
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=logits.device)
        logits = logits.index_add(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                                       device=logits.device))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(req.all_token_ids, device=logits.device).unique()
        old = logits[seen]
        logits = logits.index_copy(0, seen, torch.where(old > 0, old / p.repetition_penalty,
                                                        old * p.repetition_penalty))
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(torch.tensor(req.output_token_ids, device=logits.device),
                                minlength=logits.shape[-1]).to(logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample_one(logits: torch.Tensor, req: Request, generator: torch.Generator) -> int:
    p = req.params
    if p.greedy:
        return int(torch.argmax(logits))
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=req.generator or generator))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (its first maximum); the CPU kernel's is several times faster than torch's."""
    ops = fused_ops(logits.device.type)
    return (logits.argmax(dim=-1) if ops is None else ops.argmax_rows(logits.contiguous())).tolist()


def sample(logits: torch.Tensor, requests: list[Request], generator: torch.Generator) -> list[tuple[int, dict | None]]:
    """Returns (token id, logprobs entry or None) per request."""
    results = []
    plain_greedy = [req.params.greedy and not adjusts_logits(req) for req in requests]
    # One argmax over the whole batch instead of one per row: most requests are greedy.
    argmax = greedy_tokens(logits) if any(plain_greedy) else [None] * len(requests)
    for row, req, plain, best in zip(logits, requests, plain_greedy, argmax):
        token = best if plain else sample_one(adjust_logits(row, req), req, generator)
        entry = None
        if req.params.logprobs is not None:
            logprobs = torch.log_softmax(row, dim=-1)
            top = torch.topk(logprobs, req.params.logprobs) if req.params.logprobs else None
            entry = {
                "token_id": token,
                "logprob": float(logprobs[token]),
                "top": [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices)],
            }
        results.append((token, entry))
    return results
