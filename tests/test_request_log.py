"""The tamper-evident request log: what it holds, and `kvfence verify-log` on intact and
tampered files."""

import hashlib
import json
import subprocess
import sys

import pytest

from kvfence.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams


def verify_log(path) -> tuple[int, str]:
    r = subprocess.run(
        [sys.executable, "-m", "kvfence.cli", "verify-log", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.returncode, r.stdout


@pytest.fixture
def logged(tiny_llama_dir, tmp_path):
    """A log of 12 requests from two tenants, rotated every few lines."""
    path = tmp_path / "requests.jsonl"
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            page_size=8,
            num_kv_pages=64,
            max_model_len=128,
            request_log=str(path),
            request_log_max_mb=2000 / 2**20,
        ),
        progress=False,
    )
    for i in range(12):
        engine.add_request(
            f"secret prompt number {i}",
            SamplingParams(temperature=0, max_tokens=3),
            request_id=f"r{i}",
            tenant="alice" if i % 2 else "bob",
        )
    while engine.has_unfinished():
        engine.step()
    engine.request_log.close()
    return path, engine


def lines_of(path):
    return path.read_text().splitlines()


def test_each_finished_request_has_one_line_and_no_prompt_text(logged):
    path, engine = logged
    files = sorted(path.parent.glob("requests.jsonl*"))
    assert len(files) > 2  # rotated
    entries = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert sorted(e["request_id"] for e in entries) == sorted(f"r{i}-0" for i in range(12))
    assert sorted(e["seq"] for e in entries) == list(range(12))
    assert all("secret" not in f.read_text() for f in files)
    first = next(e for e in entries if e["request_id"] == "r1-0")
    ids = engine.tokenize("secret prompt number 1")
    assert (
        first["prompt_sha256"]
        == hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in ids)).hexdigest()
    )
    assert first["prompt_tokens"] == len(ids) and first["output_tokens"] == 3
    assert (
        first["tenant"] == "alice"
        and first["sentinel"] == "ok"
        and first["finish_reason"] == "length"
    )
    code, out = verify_log(path)
    assert code == 0 and "12 lines" in out and "intact" in out


@pytest.mark.parametrize("tamper", ["edit", "remove", "reorder"])
def test_verify_log_names_the_tampered_line(logged, tamper):
    path, _ = logged
    lines = lines_of(path)
    assert len(lines) >= 3
    if tamper == "edit":
        entry = json.loads(lines[1])
        entry["tenant"] = "mallory"
        lines[1] = json.dumps(entry)
    elif tamper == "remove":
        del lines[1]
    else:
        lines[1], lines[2] = lines[2], lines[1]
    path.write_text("\n".join(lines) + "\n")
    code, out = verify_log(path)
    assert code == 1 and "TAMPERED" in out
    assert f"{path.name} line 2" in out


def test_the_chain_continues_across_rotated_files(logged):
    path, _ = logged
    rotated = path.with_name(path.name + ".1")
    lines = lines_of(rotated)
    rotated.write_text(
        "\n".join(lines[:-1]) + "\n"
    )  # the last line before the newest file, dropped
    code, out = verify_log(path)
    assert code == 1 and f"{path.name} line 1: the chain breaks" in out


def test_a_sentinel_violation_is_in_the_log(tiny_llama_dir, tmp_path):
    path = tmp_path / "requests.jsonl"
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            page_size=8,
            num_kv_pages=64,
            max_model_len=128,
            request_log=str(path),
        ),
        progress=False,
    )
    (req,) = engine.add_request(
        list(range(1, 20)), SamplingParams(temperature=0, max_tokens=8), request_id="x"
    )
    engine.step()
    req.page_generations[0] += 1  # as if its first page had been freed and granted again
    while engine.has_unfinished():
        engine.step()
    entry = json.loads(lines_of(path)[0])
    assert entry["finish_reason"] == "error" and "generation changed" in entry["sentinel"]
