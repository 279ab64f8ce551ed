"""Options are declared once, as dataclass fields: the flags, the README's table and the choice
checks all follow from them."""

import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvfence.audit.capacity import kv_bytes_per_token
from kvfence.cli import build_parser, config_from, flag_of, flags_markdown
from kvfence.config import ConfigError, EngineConfig
from kvfence.model.config import ModelConfig
from kvfence.options import field_choices, option_types, value_type
from kvfence.server.options import ServerConfig

README = Path(__file__).resolve().parent.parent / "README.md"
CONFIGS = (EngineConfig, ServerConfig)
ALL_FIELDS = [(cls, f) for cls in CONFIGS for f in fields(cls)]

# Every flag that `kvfence serve` took before its flags were generated, with a value where it
# takes one: scripts, tests and documentation spell them so.
OLD_SERVE_FLAGS = [
    ["--host", "0.0.0.0"],
    ["--port", "8123"],
    ["--api-keys", "keys.json"],
    ["--served-model-name", "m"],
    ["--max-pending", "4"],
    ["--max-body-bytes", "1024"],
    ["--stream-stall-timeout", "2.5"],
    ["--metrics-host", "0.0.0.0"],
    ["--metrics-port", "9000"],
    ["--role", "prefill"],
    ["--kv-transfer-timeout", "5"],
    ["--park-timeout", "6"],
    ["--internal-token-file", "token"],
    ["--model", "m.gguf"],
    ["--max-model-len", "4096"],
    ["--page-size", "8"],
    ["--num-kv-pages", "100"],
    ["--kv-memory-gib", "0.5"],
    ["--max-num-seqs", "4"],
    ["--max-num-batched-tokens", "64"],
    ["--device", "cuda:0"],
    ["--enforce-eager"],
    ["--threads", "2"],
    ["--kv-sentinel", "log"],
    ["--kv-scrub", "on-free"],
    ["--attention", "torch"],
    ["--dtype", "gguf-int8"],
    ["--kv-cache-dtype", "fp8"],
    ["--no-prefix-cache"],
    ["--request-log", "log.jsonl"],
    ["--request-log-max-mb", "1.5"],
    ["--scheduling", "fifo"],
    ["--inject-fault", "legacy-reject-path"],
    ["--seed", "3"],
]
OLD_SERVE_DEFAULTS = {
    "host": "127.0.0.1",
    "port": 8000,
    "api_keys": None,
    "served_model_name": None,
    "max_pending": 256,
    "max_body_bytes": 4 * 1024 * 1024,
    "stream_stall_timeout": 30.0,
    "metrics_host": "127.0.0.1",
    "metrics_port": None,
    "role": "unified",
    "kv_transfer_timeout": 30.0,
    "park_timeout": 60.0,
    "internal_token_file": None,
    "model": None,
    "max_model_len": None,
    "page_size": 16,
    "num_kv_pages": None,
    "kv_memory_gib": 2.0,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 512,
    "device": "cpu",
    "enforce_eager": False,
    "num_threads": None,
    "kv_sentinel": "enforce",
    "kv_scrub": "off",
    "attention": "auto",
    "dtype": "auto",
    "kv_cache_dtype": "auto",
    "prefix_cache": True,
    "scheduling": "fair",
    "request_log": None,
    "request_log_max_mb": 64.0,
    "inject_fault": None,
    "seed": None,
}
MODEL = ModelConfig(
    "llama",
    100,
    64,
    128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=1e4,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def test_readme_flag_table_is_the_generated_one():
    section = README.read_text().split("### `kvfence serve` flags\n", 1)[1]
    section = re.split(r"\n#{2,3} ", section, maxsplit=1)[0]
    table = "".join(line + "\n" for line in section.splitlines() if line.startswith("|"))
    assert table == flags_markdown(), (
        "the README's flag table is out of date: replace it with the output of "
        "python -c 'from kvfence.cli import flags_markdown; print(flags_markdown(), end=\"\")'"
    )


@pytest.mark.parametrize("cls, f", ALL_FIELDS, ids=[f.name for _, f in ALL_FIELDS])
def test_every_field_is_a_documented_flag_that_sets_it(cls, f):
    help_text = f.metadata["help"]
    assert help_text and "\n" not in help_text
    kind, allowed = value_type(option_types(cls)[f.name]), field_choices(cls, f)
    if kind is bool:
        argv, expected = [flag_of(f)], not f.default
    elif allowed:
        value = next(c for c in reversed(allowed) if c != f.default)
        argv, expected = [flag_of(f), value], value
    else:
        argv, expected = [flag_of(f), "7"], kind("7")
    args = build_parser().parse_args(["serve", *argv])
    assert getattr(args, f.name) == expected


def test_no_flags_give_the_dataclass_defaults():
    args = build_parser().parse_args(["serve"])
    assert config_from(EngineConfig, args) == EngineConfig()
    assert config_from(ServerConfig, args) == ServerConfig()
    assert {name: getattr(args, name) for name in OLD_SERVE_DEFAULTS} == OLD_SERVE_DEFAULTS
    args = build_parser().parse_args(["generate", "Hello"])
    assert config_from(EngineConfig, args) == EngineConfig()


@pytest.mark.parametrize("argv", OLD_SERVE_FLAGS, ids=[a[0] for a in OLD_SERVE_FLAGS])
def test_every_old_flag_still_parses(argv):
    args = build_parser().parse_args(["serve", *argv])
    changed = {k for k, v in vars(args).items() if OLD_SERVE_DEFAULTS.get(k, v) != v}
    assert len(changed) == 1, f"{argv} should change one option, changed {changed}"


CHOICE_FIELDS = [
    (cls, f.name, field_choices(cls, f)) for cls, f in ALL_FIELDS if field_choices(cls, f)
]


@pytest.mark.parametrize("cls, name, allowed", CHOICE_FIELDS, ids=[c[1] for c in CHOICE_FIELDS])
def test_an_invalid_choice_names_the_option_and_its_choices(cls, name, allowed):
    with pytest.raises(ConfigError) as e:
        cls(**{name: "bogus"})
    msg = str(e.value)
    assert msg.startswith(f"{name} must be") and "'bogus'" in msg
    assert all(c in msg for c in allowed)


def test_invalid_choice_set_after_construction_is_caught_by_resolve():
    config = EngineConfig(num_kv_pages=64)
    config.kv_sentinel = "loud"
    with pytest.raises(ConfigError, match="kv_sentinel must be off, log or enforce, not 'loud'"):
        config.resolve(MODEL)


def test_server_checks_its_values():
    with pytest.raises(ConfigError, match="--stream-stall-timeout must be over 0"):
        ServerConfig(stream_stall_timeout=0)
    with pytest.raises(ConfigError, match="--internal-token-file is for prefill and decode"):
        ServerConfig(internal_token_file="token")
    assert ServerConfig(role="decode", internal_token_file="token").role == "decode"


@pytest.mark.parametrize(
    "dtype, blocks_run, resolved, kv, keeps",
    [
        ("auto", True, "gguf", "float32", True),
        ("auto", False, "float32", "float32", False),
        ("bfloat16", True, "bfloat16", "bfloat16", True),
        ("bfloat16", False, "bfloat16", "bfloat16", False),
        ("gguf-int8", True, "gguf-int8", "bfloat16", True),
        ("float32", True, "float32", "float32", False),
    ],
)
def test_resolve_auto(dtype, blocks_run, resolved, kv, keeps):
    config = EngineConfig(dtype=dtype)
    for _ in range(2):  # idempotent
        config.resolve_auto(blocks_run)
        assert (config.dtype, config.kv_cache_dtype, config.keeps_blocks) == (resolved, kv, keeps)


def test_resolve_resolves_auto_when_the_engine_did_not():
    config = EngineConfig(num_kv_pages=64)
    config.resolve(MODEL)
    assert (config.dtype, config.kv_cache_dtype) == ("float32", "float32")
    assert config.max_model_len == 256
    config = EngineConfig(kv_memory_gib=0.001, dtype="bfloat16")
    config.resolve(MODEL)
    assert config.kv_cache_dtype == "bfloat16"
    assert config.num_kv_pages == int(0.001 * 1024**3 // (kv_bytes_per_token(MODEL, 2) * 16))


def test_resolve_keeps_what_resolve_auto_chose():
    config = EngineConfig(num_kv_pages=64, dtype="bfloat16", kv_cache_dtype="float32")
    config.resolve_auto(gguf_blocks_run=True)
    config.resolve(MODEL)
    assert (config.dtype, config.kv_cache_dtype, config.keeps_blocks) == (
        "bfloat16",
        "float32",
        True,
    )


def test_check_config_reads_kvfence_flags_as_the_engine_does():
    """kvfence check-config runs without torch, so it keeps its own table of kvfence's pool
    flags: the defaults, KV dtype sizes and `auto` rule must be the engine's."""
    from kvfence.audit.check_config import ENGINES
    from kvfence.config import KV_CACHE_DTYPES

    spec, defaults = ENGINES["kvfence"], EngineConfig()
    assert spec.default_page_size == defaults.page_size
    assert spec.default_memory == defaults.kv_memory_gib
    assert spec.kv_dtype_bytes == {k: v.itemsize for k, v in KV_CACHE_DTYPES.items()}
    for dtype in ("float32", "gguf", "gguf-int8", "bfloat16"):
        config = EngineConfig(dtype=dtype)
        config.resolve_auto(gguf_blocks_run=True)
        assert spec.auto_kv_dtype(dtype) == config.kv_cache_dtype
