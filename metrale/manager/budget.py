"""The memory budget of resident models, and what one model is counted at.

A model is counted at its size on disk (its weights: GGUF blocks stay quantized in memory on the CPU path, a
folder's safetensors are loaded as stored) plus its KV pool (EngineConfig.kv_cache_bytes, allocated once at
start). The same estimate is used before loading (to decide what to unload) and while loaded, so that the
budget's arithmetic never depends on a measurement taken at a bad moment.

The default budget is 75% of the machine's MemTotal minus a 1 GiB margin for the server process itself.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_FRACTION = 0.75
DEFAULT_MARGIN_BYTES = 1 << 30
MEMINFO = Path("/proc/meminfo")


def mem_total_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemTotal from /proc/meminfo, or None where there is none (macOS)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def default_max_resident_bytes(meminfo: Path = MEMINFO) -> int:
    """75% of MemTotal minus 1 GiB (at least 1 GiB); ValueError where MemTotal is unknown (give the flag)."""
    total = mem_total_bytes(meminfo)
    if total is None:
        raise ValueError(f"cannot read MemTotal from {meminfo}: give --max-resident-bytes")
    return max(1 << 30, int(total * DEFAULT_FRACTION) - DEFAULT_MARGIN_BYTES)


def resident_estimate(size_on_disk: int, kv_cache_bytes: int) -> int:
    """Bytes a loaded model is counted at: its weights (size on disk) plus its KV pool."""
    return size_on_disk + kv_cache_bytes


def parse_bytes(text: str) -> int:
    """A byte count: 123, 512M, 8G, 1.5GiB (K/M/G/T are powers of 1024); ValueError otherwise."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = body[-1:] if body[-1:] in units and body[-1:] != "" else ""
    number = body[:-1] if unit else body
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a byte count such as 8G or 512M") from None
    if not value > 0 or value > 1 << 50:
        raise ValueError(f"{text!r}: a byte count must be above 0 and at most 1 PiB")
    return int(value)
