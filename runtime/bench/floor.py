"""The weight-streaming floor of a decode step, measured on this machine.

A decode step at small batch must read every weight once; no kernel can beat the time that takes at the
memory's streaming bandwidth. ``stream_bandwidth`` measures that bandwidth (a sum over a buffer four
times the last-level cache, so it comes from DRAM), ``weight_bytes`` counts the bytes a step reads in the
model's weight format, and ``weight_floor`` divides them. Benchmarks print a step's time next to its floor.

On a shared VM one probe can read well below (or above) what the memory sustains a minute later, so a run
probes more than once and ``weight_floor`` takes the fastest reading: the floor is then the lowest a run saw,
and a step's ratio to it is never flattered by a slow probe.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from radix.hugepages import anonymous


def last_level_cache_bytes() -> int:
    try:
        import os

        for index in range(4, -1, -1):
            path = f"/sys/devices/system/cpu/cpu0/cache/index{index}/size"
            if os.path.exists(path):
                text = open(path).read().strip()  # noqa: SIM115 (one read)
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
                return int(text.rstrip("KMG")) * mult
    except (OSError, ValueError):
        pass
    return 64 << 20


def stream_bandwidth(repeats: int = 5, huge_pages: bool = True) -> float:
    """Bytes per second of a multi-threaded streaming read (median of ``repeats``), from memory on huge pages where
    the kernel has them, as the packed weights are (``radix/hugepages.py``): on 4 KB pages the same read ran up to
    1.6x slower on the Zen 4 development VM, and a floor measured there would flatter every ratio to it.
    ``huge_pages=False`` reads a torch buffer (4 KB pages) instead, for comparison."""
    size = min(2 << 30, max(256 << 20, 4 * last_level_cache_bytes()))
    memory = anonymous(size) if huge_pages else torch.empty(size, dtype=torch.uint8)
    buf = memory.view(torch.float32).fill_(1.0)  # filled: every page touched before the timing
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.nbytes / statistics.median(times)


def weight_bytes(model: Any) -> int:
    """Bytes of weights one decode step reads: every linear layer and the output projection, in the format
    they are stored in for decode (packed copies where the model's ops keep them)."""
    packed = getattr(model.ops, "packed", {})
    total = 0
    for w in [*model.linear_weights(), model.output_weight()]:
        pw = packed.get(id(w))
        total += pw.nbytes if pw is not None else w.numel() * w.element_size()
    return total


def weight_floor(nbytes: int, bandwidths: list[float]) -> dict[str, Any]:
    """The floor of a decode step that reads ``nbytes`` of weights (``weight_bytes``), at the fastest of the run's
    probes (bytes per second)."""
    best = max(bandwidths)
    return {"weight_mb": nbytes / 1e6, "bandwidth_gb_s": best / 1e9,
            "probes_gb_s": [round(b / 1e9, 1) for b in bandwidths], "floor_ms": 1e3 * nbytes / best}
