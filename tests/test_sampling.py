"""Sampling parameters, stop handling, logprobs and detokenization on the real model."""

import math

import pytest
import torch

from kvfence import SamplingParams
from kvfence.config import EngineConfig
from kvfence.engine import sampler
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.request import Request
from kvfence.engine.sampler import sample
from kvfence.engine.sampling_params import FLOAT32_TINY, InvalidRequest
from kvfence.model.tokenizer import IncrementalDetokenizer

PROMPT = "Write a short story about a robot who learns to paint."


def one(llm, prompt=PROMPT, **params):
    return llm.generate(prompt, SamplingParams(**params))[0].outputs


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampler must draw from, computed the plain way: sort everything."""
    logits = logits / p.temperature
    if p.top_k > 0:
        logits = logits.masked_fill(logits < torch.topk(logits, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits, -1)
    if p.top_p < 1:
        ranked, order = torch.sort(probs, descending=True)
        ranked[(ranked.cumsum(-1) - ranked) >= p.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, ranked)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def requests_for(params: list[SamplingParams], seeds=None) -> list[Request]:
    reqs = [Request(str(i), [1], str(i), 0, p, 16) for i, p in enumerate(params)]
    for req, seed in zip(reqs, seeds or [None] * len(reqs)):
        req.generator = None if seed is None else torch.Generator().manual_seed(seed)
    return reqs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05, top_p=0.95),
    ],
    ids=["temperature", "top_p", "top_k+top_p", "min_p+top_p"],
)
def test_batched_sampling_draws_from_the_exact_distribution(params):
    """20,000 rows at once over a vocabulary of 700 (not a multiple of the draw's chunks):
    the frequencies match the distribution computed by sorting, and no token outside the
    kept set is ever drawn."""
    torch.manual_seed(0)
    logits = torch.randn(700) * 2.5
    expected = reference_probs(logits, params)
    reqs = requests_for([params] * 20_000)
    tokens = torch.tensor(
        [
            t
            for t, _ in sample(
                logits.expand(20_000, -1).contiguous(),
                reqs,
                torch.Generator().manual_seed(1),
            )
        ]
    )
    seen = torch.bincount(tokens, minlength=700) / len(tokens)
    assert (seen[expected == 0] == 0).all()
    assert (seen - expected).abs().max() < 0.012, (seen - expected).abs().max()
    if params.top_p < 1.0:
        assert 1 < (expected > 0).sum() < 700  # the cut is tested, not vacuous


def test_seeded_sampling_draws_the_same_tokens_in_any_batch():
    torch.manual_seed(1)
    logits = torch.randn(9, 49152) * 3
    mine = SamplingParams(temperature=0.9, top_p=0.9, top_k=200, seed=42)
    others = [
        SamplingParams(temperature=t, top_p=q) for t, q in ((1.0, 1.0), (0.5, 0.7), (1.5, 0.95))
    ] * 2 + [
        SamplingParams(temperature=0, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=5),
    ]
    alone = requests_for([mine], [42])
    crowd = requests_for(others[:4] + [mine] + others[4:], [None] * 4 + [42] + [None] * 4)
    drawn_alone = [sample(logits[4:5], alone, torch.Generator())[0][0] for _ in range(12)]
    drawn_in_crowd = [sample(logits, crowd, torch.Generator())[4][0] for _ in range(12)]
    assert drawn_in_crowd == drawn_alone
    assert len(set(drawn_alone)) > 3  # it samples


def test_tiny_temperatures_are_greedy():
    logits = torch.randn(3, 1000) * 5
    for temperature in (1e-6, 1e-30, 1e-45):
        reqs = requests_for([SamplingParams(temperature=temperature, top_p=0.9)] * 3)
        assert [t for t, _ in sample(logits, reqs, torch.Generator())] == logits.argmax(-1).tolist()


def test_seed_reproduces_exactly(real_llm):
    params = dict(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True)
    a = one(real_llm, seed=1234, **params)[0]
    b = one(real_llm, seed=1234, **params)[0]
    c = one(real_llm, seed=4321, **params)[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(real_llm):
    greedy = one(real_llm, temperature=0, max_tokens=16)[0]
    topk1 = one(real_llm, temperature=1.5, top_k=1, seed=7, max_tokens=16)[0]
    assert greedy.token_ids == topk1.token_ids


def test_max_tokens_and_ignore_eos(real_llm):
    out = one(real_llm, "Say yes.", temperature=0, max_tokens=40, ignore_eos=True)[0]
    assert len(out.token_ids) == 40 and out.finish_reason == "length"
    eos = 2  # <|im_end|>, the GGUF file's tokenizer.ggml.eos_token_id
    assert real_llm.engine.eos_token_ids == {eos}
    stopped = one(
        real_llm,
        "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n",
        temperature=0,
        max_tokens=40,
    )[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos


def test_stop_strings_cut_the_text(real_llm):
    full = one(real_llm, "Count: 1, 2, 3,", temperature=0, max_tokens=20)[0]
    assert " 5," in full.text
    cut = one(real_llm, "Count: 1, 2, 3,", temperature=0, max_tokens=20, stop=[" 5,"])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(" 5,")]


def test_stop_token_ids(real_llm):
    full = one(real_llm, "Count: 1, 2, 3,", temperature=0, max_tokens=10)[0]
    stop_at = full.token_ids[3]
    cut = one(
        real_llm,
        "Count: 1, 2, 3,",
        temperature=0,
        max_tokens=10,
        stop_token_ids=[stop_at],
    )[0]
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop_at) + 1]
    assert cut.finish_reason == "stop"


def test_penalties_reduce_repetition(real_llm):
    prompt = "Repeat after me: hello hello hello hello hello"
    plain = one(real_llm, prompt, temperature=0, max_tokens=32, ignore_eos=True)[0]
    penalized = one(
        real_llm,
        prompt,
        temperature=0,
        max_tokens=32,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=1.0,
    )[0]
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids))


def test_logit_bias_bans_and_forces_tokens_of_one_request_only(real_llm):
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = real_llm.generate(prompt, greedy)[0].outputs[0].token_ids
    comma = real_llm.tokenizer.encode(",", add_special_tokens=False)[0]
    banned = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100.0}
    )
    forced = SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=6,
        ignore_eos=True,
        logit_bias={comma: 100.0},
    )
    outs = real_llm.generate([prompt] * 3, [greedy, banned, forced])
    assert outs[0].outputs[0].token_ids == plain  # a neighbour's bias does not leak into this row
    assert outs[1].outputs[0].token_ids[0] != plain[0]
    assert outs[2].outputs[0].token_ids == [comma] * 6


def test_repetition_penalty_and_min_p(real_llm):
    prompt = "Repeat after me: hello hello hello hello hello"
    plain = one(real_llm, prompt, temperature=0, max_tokens=24, ignore_eos=True)[0]
    penalized = one(
        real_llm,
        prompt,
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        repetition_penalty=1.8,
    )[0]
    hello = set(real_llm.tokenizer.encode(" hello", add_special_tokens=False))
    assert sum(t in hello for t in penalized.token_ids) < sum(t in hello for t in plain.token_ids)
    # min_p = 1 keeps only the most likely token: sampling becomes greedy whatever the seed
    greedy = one(real_llm, temperature=0, max_tokens=12)[0]
    only_top = one(real_llm, temperature=1.5, min_p=1.0, seed=9, max_tokens=12)[0]
    assert only_top.token_ids == greedy.token_ids


def test_n_completions_with_seed(real_llm):
    outs = one(real_llm, temperature=1.0, n=3, seed=5, max_tokens=12)
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) == 3
    again = one(real_llm, temperature=1.0, n=3, seed=5, max_tokens=12)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]


def test_logprobs_with_top_alternatives(real_llm):
    out = one(real_llm, "The capital of France is", temperature=0, max_tokens=5, logprobs=3)[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry["token_id"] == token and len(entry["top"]) == 3
        assert entry["top"][0][0] == token  # greedy picks the most likely token
        assert math.isclose(entry["top"][0][1], entry["logprob"], abs_tol=1e-6)
        assert entry["logprob"] <= 0 and sum(math.exp(lp) for _, lp in entry["top"]) <= 1.0 + 1e-5


def test_detokenizer_never_splits_a_character(tokenizer):
    text = "naïve café — 日本語のテキスト 🎉🚀 emoji, Ελληνικά, and done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_generated_text_is_the_decoded_tokens(real_llm):
    """Token by token, the text comes out as a decode of the whole output would give it,
    leading space included."""
    out = one(real_llm, "The capital of France is", temperature=0, max_tokens=16)[0]
    assert out.text == real_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.text.startswith(" ")


def test_batch_invariance_alone_or_among_63_others(real_llm):
    """Bit for bit: a single row (one-row matmuls) against a row among 63 others."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    target = "Explain why the sky is blue in two sentences."
    alone = real_llm.generate(target, params)[0].outputs[0]
    torch.manual_seed(0)
    fillers = [
        f"Item {i}: " + " ".join(["word"] * int(torch.randint(1, 120, ()))) for i in range(63)
    ]
    crowd = real_llm.generate(fillers[:31] + [target] + fillers[31:], params)[31].outputs[0]
    assert crowd.token_ids == alone.token_ids
    assert crowd.logprobs == alone.logprobs


def tiny_engine(path, **config):
    config = EngineConfig(
        model=str(path),
        page_size=4,
        num_kv_pages=64,
        max_model_len=128,
        num_threads=1,
        **config,
    )
    return LLMEngine(config, progress=False)


def generate(engine, params: SamplingParams, prompt=(5, 6, 7, 8)) -> list[list[int]]:
    reqs = engine.add_request(list(prompt), params)
    done = {}
    while engine.has_unfinished():
        done.update({(out.request_id, out.index): out for out in engine.step() if out.finished})
    return [done[(r.parent_id, r.index)].token_ids for r in reqs]


def test_unseeded_sampling_is_seeded_from_the_os_and_a_seed_still_reproduces(
    tiny_llama_dir,
):
    """Two fresh engines draw different samples (40 tokens each from a spread-out
    distribution: a collision is vanishingly unlikely); a request's own seed, or the
    engine's configured one, reproduces its samples exactly."""
    unseeded = SamplingParams(temperature=2.0, max_tokens=40, ignore_eos=True)
    first, second = tiny_engine(tiny_llama_dir), tiny_engine(tiny_llama_dir)
    assert generate(first, unseeded) != generate(second, unseeded)
    seeded = SamplingParams(temperature=2.0, max_tokens=40, ignore_eos=True, seed=7, n=2)
    assert generate(first, seeded) == generate(second, seeded)
    configured = [generate(tiny_engine(tiny_llama_dir, seed=3), unseeded) for _ in range(2)]
    assert configured[0] == configured[1]


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 1e-46),
        ("top_p", 1e-38),
        ("min_p", 1e-46),
        ("presence_penalty", 1e-40),
        ("frequency_penalty", -1e-45),
    ],
)
def test_values_float32_cannot_hold_are_refused(field, value):
    """1e-46 is 0 in float32 (top_p=0 would keep no token), 1e-38 is a subnormal whose
    product with a probability rounds to 0: refused, naming the field."""
    with pytest.raises(InvalidRequest, match="float32") as e:
        SamplingParams(**{field: value}).validate(49152)
    assert e.value.param == field
    with pytest.raises(InvalidRequest, match="float32") as e:
        SamplingParams(logit_bias={3: 1e-46}).validate(49152)
    assert e.value.param == "logit_bias"


def test_the_smallest_top_p_accepted_keeps_the_most_likely_token():
    tiny = FLOAT32_TINY
    smallest = SamplingParams(top_p=tiny, min_p=tiny, presence_penalty=-tiny, logit_bias={3: tiny})
    smallest.validate(49152)
    logits = torch.randn(6, 49152) * 4
    reqs = requests_for([SamplingParams(top_p=FLOAT32_TINY)] * 6)
    assert [t for t, _ in sample(logits, reqs, torch.Generator())] == logits.argmax(-1).tolist()


def test_logit_bias_is_capped_at_300_tokens():
    SamplingParams(logit_bias={t: 1.0 for t in range(300)}).validate(49152)
    with pytest.raises(InvalidRequest, match="at most 300") as e:
        SamplingParams(logit_bias={t: 1.0 for t in range(301)}).validate(49152)
    assert e.value.param == "logit_bias"


def test_logit_bias_tensors_are_built_once_per_request(tiny_llama_dir, monkeypatch):
    engine = tiny_engine(tiny_llama_dir)
    forced = 1234
    bias = {t: -5.0 for t in range(299)} | {forced: 100.0}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias)
    built = []
    build = sampler.logit_bias_tensors

    def counted(p, logits):
        tensors = build(p, logits)
        built.append(tensors)
        return tensors

    monkeypatch.setattr(sampler, "logit_bias_tensors", counted)
    assert generate(engine, params) == [[forced] * 8]
    assert len(built) == 8 and all(tensors is built[0] for tensors in built)
