"""The cost of structured outputs: output tokens/s of one workload plain, held to a JSON schema,
and as forced tool calls, one request at a time and all at once, with the time each step spends
computing grammar masks (and vLLM's CPU build, xgrammar, on the same schema workload).

    python bench/structured.py [--rounds 3] [--out structured.json]
    python bench/structured.py --vllm-python VENV/bin/python --out structured.json

Workload: 16 chat prompts asking for a record (a person, a product, a place...), greedy. The
json mode holds each answer to SCHEMA (nested object, array, enum, bounded integers, strings
with maxLength, so that a small model finishes); the tools mode forces a call of `save_record`
(SCHEMA as its parameters; a second tool is offered but not chosen), the model's tool format
rendering the tools into the prompt. Each has its plain baseline: plain runs the json mode's
prompts, plain-tools the tools mode's (several times longer), with EOS ignored and each
request's max_tokens set to its constrained answer's length (from the warm-up), so that both
generate the same tokens. Concurrency 1 runs the requests one after another; N submits all of
them at once.

Mask time is what kvfence.engine.structured.mask_logits takes (timed here, around the
sampler's call), per step that masks and as a fraction of all step time; `accept` times the
matchers' consume of each sampled token. The schema's and the tool grammar's compile times
are the medians of --compiles fresh compiles.

Rounds rotate the order of the modes; each figure is the median over the rounds and each ratio
the median of the per-round ratios. vLLM (bench/vllm_structured_peer.py) gets the same token
ids, all at once, json and plain, in every round; its own json/plain ratio and kvfence's
rates against it are reported.
"""

import argparse
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from common import export_safetensors, machine_line
from kvfence import LLM, SamplingParams, StructuredOutputs
from kvfence.engine import sampler, structured
from kvfence.model.tokenizer import apply_chat_template
from peer_protocol import Peer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "kind": {"type": "string", "enum": ["person", "product", "place", "organization"]},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "details": {
            "type": "object",
            "properties": {
                "summary": {"type": "string", "maxLength": 80},
                "country": {"type": "string", "maxLength": 24},
            },
            "required": ["summary", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "year", "rating", "tags", "details"],
    "additionalProperties": False,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "save_record",
            "description": "Save a record about a person, product, place or organization.",
            "parameters": SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the catalogue.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 40}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
]
FORCED = {"type": "function", "function": {"name": "save_record"}}
MODES = ["plain", "json", "plain-tools", "tools"]
BASELINE = {"json": "plain", "tools": "plain-tools"}  # each constrained mode's plain run
ANSWERS = {plain: mode for mode, plain in BASELINE.items()}  # whose answer lengths it takes

SYSTEM = (
    "You turn text into a record with the fields name, kind, year, rating (1 to 5), tags and "
    "details (summary, country)."
)
TEXTS = [
    "Marie Curie was a physicist and chemist, born in Warsaw in 1867, who won two Nobel prizes.",
    "The Walkman, a portable cassette player released by Sony in 1979, changed how people "
    "listened to music.",
    "Kyoto, Japan's capital until 1869, is known for its temples, gardens and wooden houses.",
    "Extract the record: Ada Lovelace (1815), English mathematician, wrote the first program.",
    "The Eiffel Tower in Paris was finished in 1889 for the World's Fair; critics hated it.",
    "Rate this product: the 2021 Brompton folding bicycle. Light, sturdy, very expensive.",
    "Médecins Sans Frontières, founded in France in 1971, sends doctors to war zones.",
    "Nelson Mandela, born 1918 in South Africa, spent 27 years in prison before his presidency.",
    "The first iPhone, made by Apple in 2007, had no app store and a 3.5 inch screen.",
    "Machu Picchu is a 15th century Inca citadel high in the Andes of Peru.",
    "Summarize as a record: the Toyota Corolla, sold since 1966, the best selling car ever.",
    "The Red Cross was founded in Geneva, Switzerland, in 1863 by Henry Dunant.",
    "Frida Kahlo, a Mexican painter born in 1907, is known for her self-portraits.",
    "Reykjavik, the capital of Iceland, is the northernmost capital of a sovereign state.",
    "The LEGO brick in its modern form was patented in Denmark in 1958.",
    "UNESCO, set up in 1945 and based in Paris, protects world heritage sites.",
]


class Timer:
    """Seconds and calls of a function, replaced in its module by a timed wrapper."""

    def __init__(self, owner, name: str):
        self.inner, self.seconds, self.calls = getattr(owner, name), 0.0, 0

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


# The sampler's own reference: timing it there leaves kvfence.engine.structured untouched.
MASK = Timer(sampler, "mask_logits")
ACCEPT = Timer(structured.Matcher, "accept")


def conversations(count: int) -> list[list[dict]]:
    texts = [TEXTS[i % len(TEXTS)] for i in range(count)]
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}] for t in texts]


def prompt_ids(llm: LLM, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = apply_chat_template(llm.tokenizer, messages, tools)
    return llm.engine.tokenize(text, templated=True)


def tool_workload(llm: LLM, chats: list[list[dict]]) -> tuple[list[list[int]], str]:
    """The prompts with the tools rendered in the model's tool format, and its grammar for a
    forced call of save_record."""
    from kvfence.server.tools import detect_format  # the server's module, needed here alone

    fmt = detect_format(llm.tokenizer.chat_template, llm.tokenizer)
    prompts = [prompt_ids(llm, *fmt.render(chat, TOOLS)) for chat in chats]
    return prompts, fmt.grammar(TOOLS, FORCED, parallel=False)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], at_once: bool) -> dict:
    """Runs the requests all at once or one after another, greedy, stepping the engine; the
    prefix cache starts empty, so that no mode is served from an earlier one's prompts."""
    engine = llm.engine
    if engine.prefix_cache is not None:
        engine.prefix_cache.evict(engine.prefix_cache.num_evictable)
    MASK.reset()
    ACCEPT.reset()
    lengths, finish, texts = {}, {}, {}
    steps, step_s, generation_s, generation_tokens = 0, 0.0, 0.0, 0
    batches = [list(range(len(prompts)))] if at_once else [[i] for i in range(len(prompts))]
    start = time.perf_counter()
    for batch in batches:
        ids = {i: engine.add_request(prompts[i], params[i])[0].parent_id for i in batch}
        index = {rid: i for i, rid in ids.items()}
        while engine.has_unfinished():
            generating = not engine.scheduler.waiting and all(
                r.output_token_ids for r in engine.scheduler.running
            )
            t = time.perf_counter()
            outs = engine.step()
            seconds = time.perf_counter() - t
            steps, step_s = steps + 1, step_s + seconds
            tokens = sum(len(o.delta_token_ids) for o in outs)
            if generating:
                generation_s, generation_tokens = generation_s + seconds, generation_tokens + tokens
            for o in outs:
                if o.finished:
                    i = index[o.request_id]
                    lengths[i], finish[i], texts[i] = len(o.token_ids), o.finish_reason, o.text
    elapsed = time.perf_counter() - start
    generated = sum(lengths.values())
    return {
        "requests": len(prompts),
        "output_tokens": generated,
        "seconds": elapsed,
        "tok_s": generated / elapsed,
        "generation_tok_s": generation_tokens / generation_s if generation_s else None,
        "steps": steps,
        "step_ms": 1e3 * step_s / steps,
        "mask_steps": MASK.calls,
        "mask_ms_per_step": 1e3 * MASK.seconds / MASK.calls if MASK.calls else 0.0,
        "mask_fraction": MASK.seconds / step_s,
        "accept_ms_per_step": 1e3 * ACCEPT.seconds / MASK.calls if MASK.calls else 0.0,
        "truncated": sum(1 for r in finish.values() if r == "length"),
        "lengths": [lengths[i] for i in range(len(prompts))],
        "texts": [texts[i] for i in range(len(prompts))],
    }


def compile_ms(llm: LLM, spec: StructuredOutputs, repeats: int) -> float:
    """Median ms of compiling `spec`, each time for a fresh tenant (so never from the cache)."""
    grammars = llm.engine.grammars
    grammars.tokenizer()  # built once per engine, not per grammar
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        grammars.compile(spec, tenant=f"compile-{spec.kind()}-{i}")
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def parsed_json(texts: list[str]) -> int:
    count = 0
    for text in texts:
        try:
            json.loads(text)
            count += 1
        except ValueError:
            pass
    return count


def start_vllm(stack: ExitStack, args, llm: LLM, prompts, max_tokens, plain_lengths) -> Peer:
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    export_safetensors(llm.engine.model_path, tmp / "model")  # vLLM loads safetensors, not GGUF
    workload = {
        "schema": SCHEMA,
        "json": [[ids, max_tokens] for ids in prompts],
        "plain": [[ids, n] for ids, n in zip(prompts, plain_lengths)],
    }
    (tmp / "workload.json").write_text(json.dumps(workload))
    peer = Peer(
        args.vllm_python,
        "vllm_structured_peer.py",
        [
            *("--model", str(tmp / "model"), "--workload", str(tmp / "workload.json")),
            *("--threads", str(args.threads), "--dtype", args.vllm_dtype),
        ],
    )
    stack.callback(peer.close)
    return peer


def median_ratio(rounds: list[dict], key: str, base: str, figure: str = "tok_s") -> float:
    return statistics.median(r[key][figure] / r[base][figure] for r in rounds)


def summarize(report: dict, modes: list[str], concurrencies: list[int]) -> dict:
    rounds = report["rounds"]
    summary = {}
    for c in concurrencies:
        for mode in modes:
            key = f"{mode}@{c}"
            runs = [r[key] for r in rounds]
            summary[key] = {
                figure: statistics.median(run[figure] for run in runs)
                for figure in (
                    "tok_s",
                    "generation_tok_s",
                    "step_ms",
                    "mask_ms_per_step",
                    "mask_fraction",
                    "accept_ms_per_step",
                )
                if runs[0][figure] is not None
            }
            summary[key]["vs_plain"] = median_ratio(rounds, key, f"{BASELINE.get(mode, mode)}@{c}")
            summary[key]["output_tokens"] = runs[0]["output_tokens"]
            summary[key]["truncated"] = max(run["truncated"] for run in runs)
    if "vllm-json" in rounds[0]:
        n = concurrencies[-1]
        for mode in ("json", "plain"):
            summary[f"vllm-{mode}@{n}"] = {
                "tok_s": statistics.median(r[f"vllm-{mode}"]["tok_s"] for r in rounds),
                "kvfence_vs_vllm": median_ratio(rounds, f"{mode}@{n}", f"vllm-{mode}"),
            }
        summary[f"vllm-json@{n}"]["vs_plain"] = median_ratio(rounds, "vllm-json", "vllm-plain")
    return summary


def print_report(report: dict) -> None:
    print(
        f"\nmachine: {report['machine']}; {report['model']}; {len(report['rounds'])} rounds, "
        f"modes rotated, medians; {report['requests']} requests, greedy"
    )
    compiles = report["compile_ms"]
    print(
        f"compile: schema {compiles['json']:.1f} ms, tool grammar {compiles['tools']:.1f} ms "
        f"(medians of {report['compiles']}); tokenizer for the grammars "
        f"{report['grammar_tokenizer_ms']:.0f} ms, once per engine"
    )
    tokens = report["prompt_tokens"]
    print(f"prompt tokens, all requests: json {tokens['json']}, tools {tokens['tools']}")
    print(
        f"{'mode':>16} {'tok/s':>8} {'gen tok/s':>10} {'vs plain':>9} {'step ms':>8} "
        f"{'mask ms':>8} {'mask %':>7} {'accept ms':>10} {'tokens':>7} {'cut':>4}"
    )
    for key, s in report["summary"].items():
        if key.startswith("vllm"):
            continue
        print(
            f"{key:>16} {s['tok_s']:8.1f} {s.get('generation_tok_s', 0):10.1f} "
            f"{s['vs_plain']:9.3f} {s['step_ms']:8.2f} {s['mask_ms_per_step']:8.3f} "
            f"{100 * s['mask_fraction']:6.1f}% {s['accept_ms_per_step']:10.3f} "
            f"{s['output_tokens']:7d} {s['truncated']:4d}"
        )
    for key, s in report["summary"].items():
        if key.startswith("vllm"):
            own = f", {s['vs_plain']:.3f}x its plain" if "vs_plain" in s else ""
            print(
                f"{key:>16} {s['tok_s']:8.1f} tok/s{own}; kvfence {s['kvfence_vs_vllm']:.2f}x vLLM"
            )
    print(
        "gen tok/s: steps once every prompt is in; mask ms: per step that masks; cut: answers "
        "that hit max_tokens (the most in any round)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16, help="prompts; also the concurrency")
    ap.add_argument("--max-tokens", type=int, default=256, help="cap of a constrained answer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compiles", type=int, default=5, help="fresh compiles timed per grammar")
    ap.add_argument("--vllm-python", default=None, help="python of vLLM's CPU virtualenv")
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--out", type=Path, default=None, help="write the report here as JSON")
    args = ap.parse_args()

    llm = LLM(num_threads=args.threads, max_model_len=2048, num_kv_pages=1024)
    chats = conversations(args.requests)
    prompts = {"json": [prompt_ids(llm, chat) for chat in chats]}
    prompts["tools"], tool_grammar = tool_workload(llm, chats)
    prompts.update({"plain": prompts["json"], "plain-tools": prompts["tools"]})
    specs = {
        "json": StructuredOutputs(json=SCHEMA),
        "tools": StructuredOutputs(grammar=tool_grammar),
    }
    t = time.perf_counter()
    llm.engine.grammars.tokenizer()
    report = {
        "machine": machine_line(),
        "model": llm.engine.model_path.name,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "schema": SCHEMA,
        "tool_grammar": tool_grammar,
        "grammar_tokenizer_ms": 1e3 * (time.perf_counter() - t),
        "compiles": args.compiles,
        "compile_ms": {m: compile_ms(llm, spec, args.compiles) for m, spec in specs.items()},
        "prompt_tokens": {m: sum(map(len, p)) for m, p in prompts.items()},
        "rounds": [],
    }

    def params(mode: str) -> list[SamplingParams]:
        if mode in ANSWERS:
            return [
                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                for n in report["answer_lengths"][ANSWERS[mode]]
            ]
        spec = specs[mode]
        return [
            SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=spec)
        ] * args.requests

    # Warm-up, all at once: it also gives each request's answer lengths, the plain modes'.
    warm = {m: run(llm, prompts[m], params(m), at_once=True) for m in ("json", "tools")}
    report["answer_lengths"] = {m: w["lengths"] for m, w in warm.items()}
    run(llm, prompts["json"][:1], params("json")[:1], at_once=False)  # batch-1 shapes too
    report["json_answers_parsed"] = parsed_json(warm["json"]["texts"])
    report["sample_answers"] = {m: w["texts"][:2] for m, w in warm.items()}
    modes, concurrencies = MODES, [1, args.requests]
    with ExitStack() as stack:
        peer = None
        if args.vllm_python:
            peer = start_vllm(
                stack, args, llm, prompts["json"], args.max_tokens, report["answer_lengths"]["json"]
            )
            report["vllm"] = peer.info
        for r in range(args.rounds):
            row = {}
            order = modes[r % len(modes) :] + modes[: r % len(modes)]  # drift reaches all alike
            for c in concurrencies:
                for mode in order:
                    result = run(llm, prompts[mode], params(mode), at_once=c > 1)
                    del result["texts"]
                    row[f"{mode}@{c}"] = result
            if peer is not None:
                for mode in ("json", "plain") if r % 2 == 0 else ("plain", "json"):
                    row[f"vllm-{mode}"] = peer.run(mode)
            report["rounds"].append(row)
            print(
                f"round {r + 1}: "
                + "; ".join(f"{k} {v['tok_s']:.1f} tok/s" for k, v in row.items()),
                flush=True,
            )
    report["summary"] = summarize(report, modes, concurrencies)
    print_report(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
