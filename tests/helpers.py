"""Shared helpers of the tests: tiny models, real server processes, their metrics, and pool
checks."""

import os

TENANT_KEYS = {"sk-alice-0123456789": "alice", "sk-bob-9876543210": "bob"}
ADMIN_KEY = "sk-ops-admin-0000000"  # in write_tenant_keys' file: reads the private /metrics

ALLOW_FAULTS = {"KVFENCE_ALLOW_FAULTS": "1"}  # the environment a server with --inject-fault needs

_ports_given: set[int] = set()


# The rope scaling of the tiny Llama 3: with head_dim 16 and theta 1e4, its wavelengths fall
# in all three of Llama 3's bands (kept, interpolated, slowed down by `factor`).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def save_tiny_model(tmp_path_factory, tokenizer, arch: str, **overrides):
    """A 2-layer random-weight model with the real tokenizer, saved as a HF directory. arch:
    llama, llama3 (Llama 3's rope scaling), qwen2, qwen3 (per-head Q/K norms, a head_dim that
    is not hidden / heads) or mistral (a 32-token sliding window)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
    )
    families = {
        "llama": (LlamaForCausalLM, LlamaConfig, dict(tie_word_embeddings=False)),
        "llama3": (LlamaForCausalLM, LlamaConfig, dict(rope_scaling=LLAMA3_ROPE)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(tie_word_embeddings=True)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
        "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=32)),
    }
    model_class, config_class, extra = families[arch]
    model = model_class(config_class(**common | extra | overrides))
    for name, param in model.named_parameters():  # transformers starts biases at 0,
        if name.endswith("_proj.bias"):  # where a misplaced one would not show
            torch.nn.init.uniform_(param, -0.5, 0.5)
    if arch == "qwen3":  # random norm weights, so that a skipped Q/K norm shows
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def random_k_quant_blocks(kind: str, n: int, k: int, magnitude: float, seed: int):
    """n rows of k weights as random Q4_K, Q5_K or Q6_K blocks (gguf-py cannot quantize to
    them): random codes and sub-block scales, the fp16 super-block scales drawn so that the
    weights stay within about `magnitude`. uint8 [n, k / 256 * block bytes]."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    # Q4_K/Q5_K: d and dmin first; Q6_K: d last, times int8 scales and codes of +-32
    at, codes = (0, 31 * 63) if kind != "Q6_K" else (size - 2, 32 * 127)
    count = 2 if kind != "Q6_K" else 1
    d = (rng.uniform(0.5, 1.0, (n, k // 256, count)) * magnitude / codes).astype(np.float16)
    raw[..., at : at + 2 * count] = d.view(np.uint8)
    return raw.reshape(n, -1)


def edited_config(src, dst, drop=(), **edits):
    """A copy of the HF directory src with config.json's keys edited, and those in `drop`
    left out."""
    import json
    import shutil

    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in drop} | edits
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def save_tiny_gguf(
    hf_dir, path, tokenizer_gguf, metadata=None, types=None, arch=None, split_max_tensors=0
):
    """A HF directory's model as an F32 GGUF file, laid out as llama.cpp's converter writes it:
    Q/K rows permuted for Llama, Llama 3's rope scaling as a rope_freqs tensor, the tokenizer
    metadata copied from `tokenizer_gguf`. metadata: {key: (value, GGUFValueType)} added to (or
    replacing) the architecture's keys, named without the `{arch}.` prefix, or the tokenizer's,
    named in full. types: {suffix of
    a GGUF tensor name: GGUF type} for linear weights (or a whole name, for any tensor), stored
    in that type: quantized by gguf-py, or random K-quant blocks (random_k_quant_blocks) in
    place of the weights; the rest F32.
    arch: the GGUF architecture, where not the one the HF architecture maps to.
    split_max_tensors: split into files of that many tensors, as llama-gguf-split does."""
    import json

    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = json.loads((hf_dir / "config.json").read_text())
    arch = arch or {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}.get(
        raw["architectures"][0], "llama"
    )
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    rope = raw.get("rope_parameters") or {}
    keys = {
        "context_length": (raw["max_position_embeddings"], u32),
        "embedding_length": (raw["hidden_size"], u32),
        "block_count": (raw["num_hidden_layers"], u32),
        "feed_forward_length": (raw["intermediate_size"], u32),
        "attention.head_count": (heads, u32),
        "attention.head_count_kv": (kv_heads, u32),
        "attention.key_length": (head_dim, u32),
        "attention.value_length": (head_dim, u32),
        "rope.dimension_count": (head_dim, u32),
        "rope.freq_base": (rope.get("rope_theta", 10000.0), f32),
        "attention.layer_norm_rms_epsilon": (raw["rms_norm_eps"], f32),
    }
    if raw.get("sliding_window") and arch == "llama":
        keys["attention.sliding_window"] = (raw["sliding_window"], u32)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    own = {
        key if key.startswith("tokenizer.") else f"{arch}.{key}": kv
        for key, kv in (keys | (metadata or {})).items()
    }
    for key, (value, vtype) in own.items():
        w.add_key_value(key, value, vtype)
    for field in gguf.GGUFReader(str(tokenizer_gguf)).fields.values():
        if field.name.startswith("tokenizer.") and field.name not in own:
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub)

    tensors = load_file(str(hf_dir / "model.safetensors"))
    if rope.get("rope_type", "default") != "default":  # the factors transformers applies
        config = AutoConfig.from_pretrained(hf_dir)
        scaled, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        tensors["rope_freqs.weight"] = plain / scaled

    def permute(t, n):  # llama.cpp's LlamaModel.permute
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, t in tensors.items():
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module == "self_attn.q_proj":
                t = permute(t, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                t = permute(t, kv_heads)
            name = f"blk.{i}.{names[module]}.{kind}"
        else:
            name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }.get(name, name)
        if name == "output.weight" and raw.get("tie_word_embeddings"):
            continue
        t = np.ascontiguousarray(t.float().numpy())
        matches = (
            v
            for k, v in (types or {}).items()
            if k == name or (t.ndim == 2 and (k == "*" or name.endswith("." + k)))
        )
        kind = next(matches, "F32")
        if kind in ("Q4_K", "Q5_K", "Q6_K"):
            raw = random_k_quant_blocks(kind, *t.shape, magnitude=0.2, seed=len(name))
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        elif kind != "F32":
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_pool_empty(engine):
    """Every page is free again (or an unreferenced prefix-cache page) and nothing is queued."""
    a = engine.allocator
    assert engine.scheduler.num_unfinished == 0
    owned = (a.owner >= 0).nonzero()[0].tolist()
    assert not owned, f"pages still owned by requests: {owned}"
    assert not a.refcount.any(), "prefix-cache pages still referenced"


def write_tenant_keys(tmp_path):
    """Writes TENANT_KEYS as an --api-keys file in `tmp_path`; returns its path."""
    import json

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(TENANT_KEYS | {ADMIN_KEY: {"tenant": "ops", "admin": True}}))
    return keys


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768 up): the workers' own listeners (NIXL's
    UCX, ZMQ) bind ephemeral ports, and one once took a port picked there before its server
    had bound it. Never the same port twice in one test run."""
    import random
    import socket

    while True:
        port = random.randrange(20000, 32768)
        if port in _ports_given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port


def spawn_server(tmp_path, *args, env: dict | None = None):
    """Starts `kvfence serve` (or another subcommand) as a real process, with `env` added to
    this environment; returns (process, base URL)."""
    import subprocess
    import sys

    port = free_port()
    log = open(tmp_path / f"server-{port}.log", "w")
    cmd = [sys.executable, "-m", "kvfence.cli", *args, "--port", str(port)]
    env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(tmp_path, proc, base):
    import time

    import httpx

    port = base.rsplit(":", 1)[1]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = (tmp_path / f"server-{port}.log").read_text()
            raise RuntimeError(f"server exited: {log[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def start_server(tmp_path, *args, env: dict | None = None):
    proc, base = spawn_server(tmp_path, *args, env=env)
    return wait_healthy(tmp_path, proc, base)


def stop_server(proc):
    import subprocess

    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def metric(base: str, name: str, key: str = ADMIN_KEY) -> float:
    """Reads one unlabelled sample from /metrics, as the holder of `key` sees it."""
    import httpx

    scrape = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {key}"})
    for line in scrape.text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for_idle_pool(base: str, timeout: float = 30, key: str = ADMIN_KEY) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            metric(base, "kvfence_kv_pages_in_use_by_requests", key) == 0
            and metric(base, "kvfence_requests_running", key) == 0
        ):
            return
        time.sleep(0.2)
    raise AssertionError("KV pages still held by requests")


def run_audit(base: str | None, *extra: str) -> tuple[int, dict | str]:
    """Runs `kvfence audit --json` on `base`; returns its exit code and the report (or, when
    it could not run, its stderr)."""
    import json
    import subprocess
    import sys

    target = ["--base-url", base] if base else []
    r = subprocess.run(
        [sys.executable, "-m", "kvfence.cli", "audit", *target, "--json", "--seed", "3", *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout.strip()
    return r.returncode, (json.loads(out) if out.startswith("{") else r.stderr + out)


def start_tenant_server(tmp_path, *args: str, env: dict | None = None):
    """`kvfence serve` with TENANT_KEYS' two tenants, served as model "smollm2"."""
    keys = write_tenant_keys(tmp_path)
    return start_server(
        tmp_path,
        "serve",
        "--api-keys",
        str(keys),
        "--max-model-len",
        "1024",
        "--threads",
        "2",
        "--served-model-name",
        "smollm2",
        *args,
        env=env,
    )
