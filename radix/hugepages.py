"""Memory on transparent huge pages for what every decode step streams: the packed weights.

Why: a small-batch decode step reads every weight once, so it runs at the speed
the memory streams them. On 4 KB pages the 270 MB of SmolLM2's bf16 weights span 66k pages: each step misses the
TLB on every one of them (a two-dimensional page walk on a VM) and the hardware prefetchers stop at every 4 KB
boundary. On the Zen 4 development VM, in the same minute, a two-thread torch sum over 256 MB read 35-36 GB/s on
4 KB pages and 56-60 GB/s on 2 MB pages (in other minutes the two read alike), and the bf16 linear kernels over 30
layers' weights at one row ran 1.55x faster; whole batch-1 decode steps 6-12% faster. Linux gives
anonymous memory huge pages without being asked only in its "always" mode; in "madvise" mode (the default of many
distributions) a mapping must ask with ``madvise(MADV_HUGEPAGE)``, which torch's allocator never does.

:func:`anonymous` maps private anonymous memory aligned to a huge page and advised for huge pages (zero-filled by
the OS as it is first touched, 2 MB at a time); :class:`HugePageArena` copies tensors into such mappings one after
another. Where the kernel has no transparent huge pages ("never", or not Linux) the mappings are plain pages.
"""

from __future__ import annotations

import logging
import mmap
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # each tensor starts on a cache line: the kernels' vector loads and prefetches assume it
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_mode() -> str:
    """The kernel's transparent huge page mode: "always", "madvise" or "never" ("never" where there is no
    such setting)."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _map(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A private anonymous mapping of ``nbytes`` (+ alignment slack) and a uint8 tensor over ``nbytes`` of it whose
    start is aligned to a huge page, all of it advised for huge pages. Every tensor made from it holds a reference
    to the mapping (``torch.frombuffer``), which keeps it mapped."""
    # private: a shared anonymous mapping is shmem, whose huge pages follow another setting (often "never")
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # + alignment slack
    start, view = _aligned(mapping, nbytes)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes:
        mapping.madvise(advice, start, len(mapping) - start)
    return mapping, view


def _aligned(mapping: mmap.mmap, nbytes: int) -> tuple[int, torch.Tensor]:
    """The offset of ``mapping``'s first huge page boundary, and a uint8 tensor over ``nbytes`` from there."""
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return start, whole[start:start + nbytes]


def anonymous(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zero-filled private anonymous memory as a uint8 tensor (which keeps the mapping alive), its
    start aligned to a huge page and the whole of it advised for huge pages."""
    return _map(nbytes)[1]


class MappingPool:
    """Huge-page mappings kept once nothing placed in them is alive, for the next arena to reuse.

    Why: under a VM the first touch of a fresh huge page is slow (the hypervisor backs it then): on the Zen 4
    development VM, copying a cascade group's 24 MB of packs into fresh huge pages took ~28 ms (4 KB pages: 6 ms; the
    same pages again: 1.5 ms), once per new group, stalling that step for every request in it. A mapping here is
    idle when no tensor over it is alive: each tensor made over it holds a reference to the mapping, so its
    reference count says so. Memory handed out again is not zeroed. Idle mappings beyond ``keep_bytes`` are unmapped.
    """

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self._mappings: list[tuple[mmap.mmap, int]] = []  # (mapping, usable bytes), oldest first
        self.mapped = 0  # bytes of the mappings opened, over the pool's life
        # what _idle reads for a mapping nothing else holds, measured the same way on a probe rather than assumed
        # (how getrefcount counts its own argument is the interpreter's business)
        probe = [(mmap.mmap(-1, mmap.PAGESIZE), 0)]
        self._unheld = sys.getrefcount(probe[0][0])
        probe[0][0].close()

    def _idle(self, i: int) -> bool:
        """Whether nothing but the pool holds mapping ``i``. Indexed, not passed: a name bound to the mapping would
        be one more reference."""
        return sys.getrefcount(self._mappings[i][0]) <= self._unheld

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` on huge pages (contents undefined), in the smallest idle mapping that
        holds it, or in a new one rounded up to an eighth of its power of two so that groups of nearby sizes
        can share it later."""
        fits = [i for i in range(len(self._mappings)) if self._mappings[i][1] >= nbytes and self._idle(i)]
        if fits:
            best = min(fits, key=lambda i: self._mappings[i][1])
            return _aligned(self._mappings[best][0], nbytes)[1]
        step = max(HUGE_PAGE, (1 << max(nbytes - 1, 1).bit_length()) // 8)
        capacity = _round_up(nbytes, step)
        mapping, view = _map(capacity)
        self._mappings.append((mapping, capacity))
        self.mapped += capacity
        self._trim()
        return view[:nbytes]

    def _trim(self) -> None:
        """Unmap the oldest idle mappings while the idle ones hold more than ``keep_bytes``."""
        idle = [i for i in range(len(self._mappings)) if self._idle(i)]
        excess = sum(self._mappings[i][1] for i in idle) - self.keep_bytes
        dropped: list[int] = []  # oldest first, as idle is
        for i in idle:
            if excess <= 0:
                break
            excess -= self._mappings[i][1]
            dropped.append(i)
        for i in reversed(dropped):
            self._mappings.pop(i)[0].close()

    @property
    def held(self) -> int:
        """Bytes of the mappings the pool holds, in use or idle."""
        return sum(cap for _, cap in self._mappings)


class _Mapping:
    """One mapping of ``capacity`` bytes (:func:`anonymous`, or from a :class:`MappingPool`), filled from the start."""

    def __init__(self, capacity: int, pool: MappingPool | None):
        self.capacity = capacity
        self.bytes = pool.take(capacity) if pool is not None else anonymous(capacity)
        self.used = 0


class HugePageArena:
    """Tensors copied into anonymous mappings on huge pages, one after another.

    :meth:`place` copies a contiguous tensor into the next free 64-byte-aligned slice of the current mapping, and
    opens a new mapping of ``chunk`` bytes (or the tensor's size, rounded up to a huge page, if larger) when it does
    not fit; so a caller can pack one weight at a time and drop each packed original at once (a model's weights
    never sit in memory twice over). A mapping lives as long as any tensor placed in it.
    """

    def __init__(self, chunk: int = 256 << 20, pool: MappingPool | None = None):
        self.chunk = _round_up(chunk, HUGE_PAGE)
        self.pool = pool  # where the mappings come from: fresh ones (zeroed) when None
        self._current: _Mapping | None = None
        self.mapped = 0  # bytes of all mappings opened
        self.used = 0  # bytes of the tensors placed

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` (contiguous, on the CPU) in the arena."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError("only contiguous CPU tensors can be placed")
        n = tensor.nbytes
        cur = self._current
        at = _round_up(cur.used, ALIGN) if cur is not None else 0
        if cur is None or at + n > cur.capacity:
            cur = self._current = _Mapping(max(self.chunk, _round_up(n, HUGE_PAGE)), self.pool)
            self.mapped += cur.capacity
            at = 0
        copy = cur.bytes[at:at + n].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        cur.used = at + n
        self.used += n
        return copy


def weight_arena() -> HugePageArena | None:
    """An arena for weights where the kernel has transparent huge pages; None (keep them where they are) where it
    has none."""
    mode = huge_pages_mode()
    if mode == "never":
        logger.info("weights stay on 4 KB pages (no transparent huge pages here)")
        return None
    return HugePageArena()
