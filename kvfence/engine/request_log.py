"""A tamper-evident request log: one JSON line per finished request, each chained to the one
before by SHA-256, rotated by size with the chain running on across files.

Each line carries `seq` (its number since the log began), `prev` (the hash of the line
before, or of nothing for the first) and `hash` (of the line's own content with `prev`).
Editing, removing or reordering a line breaks the chain at that line; verify() says where.
Rewriting every line from some point on, hashes included, is only caught against a hash
kept elsewhere: the last line's hash is what to copy out.
"""

import hashlib
import json
import os
import threading
import time
from dataclasses import MISSING, dataclass
from pathlib import Path

from kvfence.options import option

GENESIS = "0" * 64


def audit_record(record: dict, req, sentinel: str) -> dict:
    """What an auditor gets of a finished request: its record, the wall-clock time it arrived,
    the sentinel's verdict, and the prompt as a SHA-256 of its token ids (4 bytes each,
    little-endian) with its length, never its text."""
    prompt = b"".join(t.to_bytes(4, "little") for t in req.prompt_token_ids)
    verdict = "off" if sentinel == "off" else (req.sentinel_violation or "ok")
    return {
        **record,
        "arrived_at": round(time.time() - (time.monotonic() - req.arrival_time), 3),
        "sentinel": verdict,
        "prompt_sha256": hashlib.sha256(prompt).hexdigest(),
    }


def line_hash(entry: dict) -> str:
    """The hash of a line's content: every field but `hash`, in a canonical JSON form."""
    content = {k: v for k, v in entry.items() if k != "hash"}
    return hashlib.sha256(
        json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def log_files(path: Path) -> list[Path]:
    """The rotated files oldest first (FILE.N ... FILE.1), then FILE itself."""
    rotated = sorted(
        (p for p in path.parent.glob(path.name + ".*") if p.suffix[1:].isdigit()),
        key=lambda p: -int(p.suffix[1:]),
    )
    return rotated + ([path] if path.exists() else [])


def _last_entry(files: list[Path]) -> dict | None:
    for f in reversed(files):
        lines = f.read_text().splitlines()
        if lines:
            return json.loads(lines[-1])
    return None


class RequestLog:
    def __init__(self, path: str | Path, max_bytes: int = 64 * 1024 * 1024, backups: int = 10):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        last = _last_entry(log_files(self.path))  # a restarted server continues the chain
        self._seq = last["seq"] + 1 if last else 0
        self._prev = last["hash"] if last else GENESIS
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        with self._lock:
            entry = {**record, "seq": self._seq, "prev": self._prev}
            entry["hash"] = line_hash(entry)
            line = json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n"
            if self._file.tell() and self._file.tell() + len(line) > self.max_bytes:
                self._rotate()
            self._file.write(line)
            self._file.flush()
            self._seq += 1
            self._prev = entry["hash"]

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()


@dataclass
class Verdict:
    lines: int
    problems: list[str]
    last_hash: str
    first_seq: int = 0  # above 0: the oldest lines were rotated out of the kept files

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(path: str | Path) -> Verdict:
    """Walks the chain through every file of the log; names each line where it breaks."""
    files = log_files(Path(path))
    if not files:
        return Verdict(0, [f"{path}: no such log"], GENESIS)
    problems, count, prev, seq, first_seq = [], 0, None, None, 0
    for f in files:
        for number, text in enumerate(f.read_text().splitlines(), 1):
            where = f"{f.name} line {number}"
            count += 1
            try:
                entry = json.loads(text)
                stored = entry["hash"]
            except (ValueError, KeyError, TypeError):
                problems.append(f"{where}: not a log line")
                prev, seq = None, None
                continue
            if line_hash(entry) != stored:
                problems.append(f"{where}: edited (its content does not match its hash)")
            if prev is not None and entry.get("prev") != prev:
                problems.append(
                    f"{where}: the chain breaks here (a line before it was removed, "
                    "edited or moved)"
                )
            if count == 1:
                first_seq = entry.get("seq", 0)
                if (first_seq == 0) != (entry.get("prev") == GENESIS):
                    problems.append(
                        f"{where}: the first line kept does not start the chain it claims"
                    )
            if seq is not None and entry.get("seq") != seq + 1:
                problems.append(f"{where}: line number {entry.get('seq')} follows {seq}")
            prev, seq = stored, entry.get("seq")
    return Verdict(count, problems, prev or GENESIS, first_seq)


@dataclass
class VerifyLogOptions:
    file: str = option(MISSING, "a --request-log file", positional=True)


def run_verify_log(options: VerifyLogOptions) -> int:
    verdict = verify(options.file)
    for problem in verdict.problems:
        print(problem)
    start = (
        f" from line {verdict.first_seq} (earlier ones rotated away)" if verdict.first_seq else ""
    )
    state = "intact" if verdict.ok else f"TAMPERED ({len(verdict.problems)} problems)"
    print(f"{options.file}: {verdict.lines} lines{start}, {state}; last hash {verdict.last_hash}")
    return 0 if verdict.ok else 1
