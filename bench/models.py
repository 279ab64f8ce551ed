"""kvfence against llama.cpp on the K-quant files people serve, same file, same threads, same
run: a random-weight model of Llama-3.2-1B's shapes in llama.cpp's Q4_K_M, and the default
SmolLM2 in its Q4_1 file and re-quantized to Q4_K_M.

    python bench/models.py --llamacpp-python VENV/bin/python \\
        --llama-batched-bench LLAMA_CPP/build/bin/llama-batched-bench [--rounds 3]

VENV holds llama.cpp's quantizer and loader: `python3 -m venv VENV && VENV/bin/pip install
llama-cpp-python==0.3.36`. llama-batched-bench is built as bench/batched.py says.

The 1B model: Llama-3.2-1B's config (16 layers 2048 wide, MLP 8192, 32 heads of 64 and 8
KV heads, tied embeddings, llama3 rope scaling written as a rope_freqs tensor), random F16
weights, SmolLM2's tokenizer padded as Llama 3's is laid out: ordinary tokens up to 128,000
ids, then 256 reserved control tokens (it keeps SmolLM2's 49k merges, where Llama 3 has
280k); llama.cpp quantizes it to Q4_K_M. Throughput does not depend on the weights' values.

Per file, each in a fresh process: load time and peak RSS (VmHWM) of kvfence (a 64-page
pool) in each --dtypes mode (gguf: exact; gguf-int8: llama.cpp's arithmetic), its tokenizer
already converted from the file's metadata and cached as at any start after the first, and of
llama.cpp (llama-cpp-python, the file memory-mapped), against the file's size. Then
bench/batched.py's scenario, 128 prompt and 128 new tokens a request: generation tok/s of a
single stream, and output tok/s (prefill included) of 16 requests at once, every engine,
rounds alternating; medians and the medians of the per-round ratios to llama.cpp.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from batched import kvfence_figures, run_llamacpp

from common import flops_per_token, int8_peak_gops, machine_line
from kvfence import LLM
from kvfence.model.arch import llama3_rope_factors
from kvfence.model.loader import default_model_path
from kvfence.model.tokenizer import load_tokenizer

# isort: split
import numpy as np
import torch  # after kvfence (see common.py)

LLAMA_3_2_1B = {
    "block_count": 16,
    "embedding_length": 2048,
    "feed_forward_length": 8192,
    "attention.head_count": 32,
    "attention.head_count_kv": 8,
    "vocab_size": 128256,
    "rope.freq_base": 500000.0,
    "rope.scaling": (32.0, 1.0, 4.0, 8192),  # factor, low and high frequency factors, context
}

RESERVED = 256  # Llama 3's control tokens, after its 128,000 ordinary ones

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.allow_requantize = True
params.nthread = int(sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""

# Each prints {"load_s", "rss_mib", "import_mib"}; the clock starts once the libraries are
# imported, and import_mib is the RSS then. The peak is this process's own (VmHWM):
# ru_maxrss would count the parent's pages at the fork. kvfence adds the bytes of the weights
# its model keeps (kept_mib) and the RSS it holds once loaded, ready to serve (held_mib).
KVFENCE_LOAD = """
import json, sys, time
from kvfence import LLM
import transformers.tokenization_utils_tokenizers  # the tokenizer's library, with torch
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) / 1024
imported = status("VmRSS")
t = time.perf_counter()
path, threads, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(path, num_threads=threads, max_model_len=1024, num_kv_pages=64, dtype=dtype)
seconds = time.perf_counter() - t
model = llm.engine.runner.model
kept = sum(lin.packed.nbytes for lin in [model.lm_head] + [
    getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")
]) + (0 if model.embed is None else model.embed.nbytes)
print(json.dumps({
    "load_s": seconds, "rss_mib": status("VmHWM"), "import_mib": imported, "kept_mib": kept / 2**20,
    "held_mib": status("VmRSS"),
}))
"""
LLAMACPP_LOAD = """
import json, sys, time
from llama_cpp import Llama
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) / 1024
imported = status("VmRSS")
t = time.perf_counter()
Llama(sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=1024, verbose=False)
seconds = time.perf_counter() - t
print(json.dumps({"load_s": seconds, "rss_mib": status("VmHWM"), "import_mib": imported}))
"""


def write_random_llama(path: Path, shapes: dict, tokenizer_gguf: Path, seed: int = 0) -> None:
    """An F16 GGUF file of random weights with `shapes`, laid out as llama.cpp's converter
    writes a Llama 3 model, with `tokenizer_gguf`'s tokenizer padded to the vocabulary."""
    import gguf

    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    w = gguf.GGUFWriter(str(path), "llama")
    hidden, heads = shapes["embedding_length"], shapes["attention.head_count"]
    head_dim, vocab = hidden // heads, shapes["vocab_size"]
    for key, value in shapes.items():
        if key != "rope.scaling":
            vtype = (
                gguf.GGUFValueType.FLOAT32
                if isinstance(value, float)
                else gguf.GGUFValueType.UINT32
            )
            w.add_key_value(f"llama.{key}", value, vtype)
    w.add_uint32("llama.context_length", 131072)
    w.add_uint32("llama.rope.dimension_count", head_dim)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            # Llama 3's layout: ordinary tokens up to 128,000, then 256 reserved control tokens
            ordinary = vocab - RESERVED - len(value)
            value += (
                [f"<|padding_token_{i}|>" for i in range(ordinary)]
                + [f"<|reserved_special_token_{i}|>" for i in range(RESERVED)]
                if key.endswith("tokens")
                else [int(gguf.TokenType.NORMAL)] * ordinary
                + [int(gguf.TokenType.CONTROL)] * RESERVED
            )
        w.add_key_value(
            key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None
        )
    factor, low, high, context = shapes["rope.scaling"]
    theta = shapes["rope.freq_base"]
    factors = llama3_rope_factors(head_dim, theta, factor, low, high, context)
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    kv = shapes["attention.head_count_kv"] * head_dim
    ffn = shapes["feed_forward_length"]
    w.add_tensor("token_embd.weight", weight(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(shapes["block_count"]):
        for name, rows, cols in (
            ("attn_q", hidden, hidden),
            ("attn_k", kv, hidden),
            ("attn_v", kv, hidden),
            ("attn_output", hidden, hidden),
            ("ffn_gate", ffn, hidden),
            ("ffn_up", ffn, hidden),
            ("ffn_down", hidden, ffn),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", weight(rows, cols))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(llamacpp_python: str, source: Path, target: Path, threads: int) -> None:
    subprocess.run(
        [llamacpp_python, "-c", QUANTIZE, str(source), str(target), str(threads)],
        check=True,
        capture_output=True,
    )


def load_figures(python: str, code: str, model: Path, threads: int, *args: str) -> dict:
    done = subprocess.run(
        [python, "-c", code, str(model), str(threads), *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--llamacpp-python", required=True, help="python of a llama-cpp-python venv")
    ap.add_argument("--llama-batched-bench", required=True, help="llama.cpp's binary")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", type=Path, default=None, help="where the files go (a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--dtypes", default="gguf,gguf-int8", help="kvfence --dtype modes, comma-separated"
    )
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    torch.set_num_threads(args.threads)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvfence-models-"))
    work.mkdir(parents=True, exist_ok=True)
    files = {
        "Llama-3.2-1B shapes, Q4_K_M": work / "llama-3.2-1b-random.Q4_K_M.gguf",
        "SmolLM2-135M, Q4_1": default_model_path(),
        "SmolLM2-135M, Q4_K_M": work / "smollm2-135m.Q4_K_M.gguf",
    }
    if not files["Llama-3.2-1B shapes, Q4_K_M"].exists():
        f16 = work / "llama-3.2-1b-random.F16.gguf"
        write_random_llama(f16, LLAMA_3_2_1B, default_model_path())
        quantize(args.llamacpp_python, f16, files["Llama-3.2-1B shapes, Q4_K_M"], args.threads)
        f16.unlink()
    if not files["SmolLM2-135M, Q4_K_M"].exists():
        quantize(
            args.llamacpp_python, default_model_path(), files["SmolLM2-135M, Q4_K_M"], args.threads
        )

    report = {"machine": machine_line(), "files": {}, "int8_peak_gops": int8_peak_gops()}
    for label, path in files.items():
        load_tokenizer(path)  # the first start converts it from the file's metadata, then caches
        loads = {
            f"kvfence {dtype}": load_figures(
                sys.executable, KVFENCE_LOAD, path, args.threads, dtype
            )
            for dtype in dtypes
        }
        loads["llama.cpp"] = load_figures(args.llamacpp_python, LLAMACPP_LOAD, path, args.threads)
        llms = {
            dtype: LLM(
                str(path),
                num_threads=args.threads,
                max_model_len=1024,
                kv_memory_gib=3.0,
                dtype=dtype,
            )
            for dtype in dtypes
        }
        for llm in llms.values():
            kvfence_figures(llm, 2, 16, 2, seed=1)  # warm-up
        rounds = []
        for r in range(args.rounds):
            figures = {
                f"kvfence {dtype}": {b: kvfence_figures(llm, b, 128, 128, seed=r) for b in (1, 16)}
                for dtype, llm in llms.items()
            }
            figures["llama.cpp"] = run_llamacpp(
                args.llama_batched_bench, path, args.threads, [1, 16], 128, 128
            )
            rounds.append(figures)
        cfg = next(iter(llms.values())).engine.model_config
        del llms
        report["files"][label] = {
            "path": str(path),
            "file_mib": path.stat().st_size / 2**20,
            "load": loads,
            "rounds": rounds,
            # the 16 requests' linear layers: 128 prompt tokens each through the layers, and
            # 128 new tokens through the layers and the output layer
            "ops_16": 16 * 128 * (flops_per_token(cfg, False) + flops_per_token(cfg)),
        }
        print_file(label, report["files"][label], report["int8_peak_gops"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(f"machine: {report['machine']}; {args.rounds} rounds, medians")


def print_file(label: str, result: dict, int8_peak: float | None) -> None:
    rounds, file_mib = result["rounds"], result["file_mib"]
    print(f"\n{label}: {Path(result['path']).name}, {file_mib:.0f} MiB")
    for tool, load in result["load"].items():
        kept = ""
        if "kept_mib" in load:  # what the load itself added, against the weights it kept
            added = load["rss_mib"] - load["import_mib"]
            kept = (
                f"; weights kept {load['kept_mib']:.0f} MiB, the load added {added:.0f} MiB, "
                f"{added / load['kept_mib']:.2f}x them; {load['held_mib']:.0f} MiB held once loaded"
            )
        print(
            f"  {tool:9s} load {load['load_s']:.1f} s, peak RSS {load['rss_mib']:.0f} MiB "
            f"({load['rss_mib'] / file_mib:.2f}x the file; {load['import_mib']:.0f} MiB of it "
            f"before the load, with the libraries imported{kept})"
        )
    for b, figure, name in (
        (1, "generation_tok_s", "single stream"),
        (16, "output_tok_s", "16 at once"),
    ):
        theirs = [r["llama.cpp"][b][figure] for r in rounds]
        line = f"  {name:13s} llama.cpp {statistics.median(theirs):.1f} tok/s"
        for tool in [t for t in rounds[0] if t != "llama.cpp"]:
            ours = [r[tool][b][figure] for r in rounds]
            ratio = statistics.median(x / y for x, y in zip(ours, theirs))
            line += f"; {tool} {statistics.median(ours):.1f} tok/s, {ratio:.2f}x"
        print(line)
    if int8_peak:  # what the cores' int8 rate allows, were every product at that rate
        ceiling = 16 * 128 / (result["ops_16"] / (int8_peak * 1e9))
        theirs = statistics.median(r["llama.cpp"][16]["output_tok_s"] for r in rounds)
        print(
            f"  16 at once at the int8 peak ({int8_peak:.0f} G/s, linear layers only): "
            f"{ceiling:.1f} tok/s, {ceiling / theirs:.2f}x llama.cpp"
        )


if __name__ == "__main__":
    main()
