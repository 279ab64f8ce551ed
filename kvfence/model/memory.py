"""What loading a model costs in memory: the check that the weights will fit, the line on what
stays as stored and what is dequantized, and freed heap handed back to the system."""

import ctypes
from pathlib import Path

from kvfence.model.config import ModelLoadError
from kvfence.model.quant import KEPT_TYPES


def return_freed_heap() -> None:
    """Hands the memory the load's temporaries freed back to the system: glibc keeps freed heap
    pages in the process (about 200 MB over a 1B model's load) unless asked."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to ask
        pass


def check_fits(path: Path, tensors: list, kept: set[str]) -> None:
    """Refuses a CPU load in blocks (--dtype gguf, gguf-int8) whose weights (`tensors` at
    about their file's bytes where kept, others as fp32) would not fit the memory available
    now, naming what is dequantized, before anything is read."""
    rest = [t for t in tensors if t.name not in kept]
    fp32 = sum(t.n_elements for t in rest) * 4
    need = fp32 + sum(t.n_bytes for t in tensors if t.name in kept)
    available = _available_memory()
    if available is not None and need > available:
        raise ModelLoadError(
            f"{path.name} would take about {_size(need)} once loaded, {_size(fp32)} of it "
            f"dequantized to float32 ({_summary(rest) or 'none'}), more than the "
            f"{_size(available)} of memory available: use --dtype gguf on a file whose types "
            f"stay as stored ({', '.join(KEPT_TYPES)}), or a smaller model"
        )


def kept_line(path: Path, tensors: list, kept: set[str]) -> str:
    """One line on what stayed as stored and what was dequantized, bytes per GGUF type: of
    `tensors`, the linear weights and the embedding."""
    rest = [t for t in tensors if t.name not in kept]
    line = f"{path.name}: weights kept as stored: "
    line += _summary([t for t in tensors if t.name in kept]) or "none"
    if rest:
        fp32 = sum(t.n_elements for t in rest) * 4
        cost = fp32 / sum(t.n_bytes for t in rest)
        line += f"; dequantized to float32 ({_size(fp32)}, {cost:.1f}x their bytes in the file"
        line += f", read at that size every token): {_summary(rest)}"
    return line


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is none to read."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _summary(group: list) -> str:
    """Tensors counted and sized per GGUF type: "2 Q4_K (1.5 MiB), 1 F16 (2.0 MiB)"."""
    by_type: dict[str, list[int]] = {}
    for t in group:
        count = by_type.setdefault(t.tensor_type.name, [0, 0])
        count[0] += 1
        count[1] += t.n_bytes
    return ", ".join(f"{n} {kind} ({_size(b)})" for kind, (n, b) in by_type.items())


def _size(n_bytes: int) -> str:
    if n_bytes >= 2**30:
        return f"{n_bytes / 2**30:.1f} GiB"
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes / 2**10:.0f} KiB"
