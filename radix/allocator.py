"""Paged allocation of KV slots and the request-to-token table.

A *slot* holds the K and V vectors of one token in every layer (see ``kv_storage``). Slots are grouped
into pages of ``page_size`` consecutive slots: slot ``s`` belongs to page ``s // page_size``. Ownership is
tracked per page, so a request's partially filled last page is still wholly its own.

Page 0 is reserved and never handed out: padded rows of a batch (CUDA graphs, dummy requests) may write
their KV there without touching anyone's data. Capacity therefore counts pages ``1..num_pages``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radix.errors import DoubleFreeError, KVOutOfMemoryError, UnownedSlotError


class PagedAllocator:
    """Hands out KV slots a page at a time and takes them back, refusing any misuse loudly."""

    def __init__(self, capacity_tokens: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if capacity_tokens < page_size:
            raise ValueError(f"capacity_tokens ({capacity_tokens}) is less than one page ({page_size})")
        self.page_size = page_size
        self.num_pages = capacity_tokens // page_size
        self.device = torch.device(device)
        # Slot count of the storage this allocator indexes, including the reserved page 0.
        self.total_slots = (self.num_pages + 1) * page_size
        self._is_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._is_free[0] = False
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        # How often each page was freed (reset counts for all): see times_freed().
        self._free_counts = torch.zeros(self.num_pages + 1, dtype=torch.int64)
        self.reset()

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """Usable capacity in tokens (whole pages, page 0 excluded)."""
        return self.num_pages * self.page_size

    @property
    def free_size(self) -> int:
        """Free capacity in tokens."""
        return len(self._free_pages) * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    # ------------------------------------------------------------------ alloc / free
    def times_freed(self, slots: torch.Tensor) -> int:
        """How often the pages under ``slots`` were freed, summed (a page counts once per slot on it).

        A slot's KV is rewritten only after its page was freed and handed out again, and the counts only grow,
        so two equal answers for the same slots mean their KV did not change in between: what lets a kernel
        keep work derived from a cached prefix's KV across steps while other requests come and go."""
        return int(self._free_counts[self._pages_of(slots)].sum())

    def reset(self) -> None:
        """Everything free again (pages handed out before are forgotten, so only call it when idle)."""
        self._free_counts += 1
        # Popping from the end hands out low page numbers first, which keeps small pools easy to read.
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))
        self._is_free[1:] = True

    def alloc_pages(self, n_pages: int) -> torch.Tensor:
        """Allocate ``n_pages`` whole pages; returns their page numbers (int64)."""
        if n_pages < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n_pages})")
        if n_pages > len(self._free_pages):
            raise KVOutOfMemoryError(
                f"asked for {n_pages} pages ({n_pages * self.page_size} tokens) but only "
                f"{len(self._free_pages)} pages ({self.free_size} tokens) are free"
            )
        if n_pages == 0:
            return torch.empty(0, dtype=torch.int64)
        taken = self._free_pages[-n_pages:]
        del self._free_pages[-n_pages:]
        taken.reverse()
        pages = torch.tensor(taken, dtype=torch.int64)
        self._is_free[pages] = False
        return pages

    def alloc(self, n_tokens: int) -> torch.Tensor:
        """Allocate slots for ``n_tokens`` tokens starting on a fresh page; returns the slot indices."""
        pages = self.alloc_pages(self.pages_for(n_tokens))
        return self.pages_to_slots(pages)[:n_tokens]

    def alloc_extend(self, cur_len: int, last_slot: int, n_tokens: int) -> torch.Tensor:
        """Slots for ``n_tokens`` more tokens of a sequence that already holds ``cur_len`` tokens.

        The sequence's next token goes into the unused tail of its last page (whose last used slot is
        ``last_slot``) before any new page is taken, so position ``p`` of a sequence always lives at
        offset ``p % page_size`` of its page: the layout paged attention kernels expect.
        """
        if n_tokens <= 0:
            return torch.empty(0, dtype=torch.int64)
        used_in_page = cur_len % self.page_size
        if used_in_page == 0 or cur_len == 0:
            return self.alloc(n_tokens)
        room = self.page_size - used_in_page
        head = torch.arange(last_slot + 1, last_slot + 1 + min(room, n_tokens), dtype=torch.int64)
        if n_tokens <= room:
            return head
        return torch.cat([head, self.alloc(n_tokens - room)])

    def alloc_next(self, cur_lens: Sequence[int], last_slots: Sequence[int]) -> torch.Tensor:
        """One more slot for each of several sequences (a decode step's), in one allocation.

        Sequence ``i`` holds ``cur_lens[i]`` tokens, its last in slot ``last_slots[i]`` (read only when its
        page has room). The slots are those ``alloc_extend(cur_lens[i], last_slots[i], 1)`` would give each in
        turn: the next slot of a page with room, else the first slot of a fresh page, fresh pages handed out in
        the sequences' order.
        """
        ps = self.page_size
        out = [last + 1 for last in last_slots] if ps > 1 else [0] * len(cur_lens)
        fresh = [i for i, n in enumerate(cur_lens) if n % ps == 0]
        if fresh:
            for i, page in zip(fresh, self.alloc_pages(len(fresh)).tolist()):
                out[i] = page * ps
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages that ``slots`` lie on.

        Raises ``DoubleFreeError`` if a page is already free and ``UnownedSlotError`` for a slot outside
        the pool or on the reserved page; nothing is freed when it raises.
        """
        if slots.numel() == 0:
            return
        pages = torch.unique(self._pages_of(slots))
        if int(pages[0]) < 1 or int(pages[-1]) > self.num_pages:
            raise UnownedSlotError(
                f"slots {slots.min().item()}..{slots.max().item()} are outside the pool "
                f"(valid slots {self.page_size}..{self.total_slots - 1})"
            )
        already = self._is_free[pages]
        if bool(already.any()):
            raise DoubleFreeError(f"pages {pages[already].tolist()[:8]} are already free")
        self._is_free[pages] = True
        self._free_pages.extend(pages.tolist())
        self._free_counts[pages] += 1

    # ------------------------------------------------------------------ helpers
    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def free_page_set(self) -> set[int]:
        return set(self._free_pages)

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        return self._is_free[self._pages_of(slots)]

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The pages under ``slots``, on the CPU where the bookkeeping lives: on a GPU the slots usually come
        from the request-to-token table or the radix tree, both on the device."""
        return slots.to(device="cpu", dtype=torch.int64) // self.page_size


class ReqToTokenPool:
    """Request slot × position → KV slot.

    Each running request owns one row; ``table[row, p]`` is the KV slot of its token at position ``p``.
    Attention backends read the rows to find a request's KV; the scheduler writes them as it allocates.
    """

    def __init__(self, max_requests: int, max_context_len: int, device: str | torch.device = "cpu"):
        if max_requests < 1 or max_context_len < 1:
            raise ValueError("max_requests and max_context_len must be >= 1")
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.table = torch.zeros((max_requests, max_context_len), dtype=torch.int64, device=device)
        self.reset()

    def reset(self) -> None:
        self._free_rows: list[int] = list(range(self.max_requests - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise KVOutOfMemoryError(f"all {self.max_requests} request slots are in use")
        row = self._free_rows.pop()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._used:
            raise DoubleFreeError(f"request slot {row} is not in use")
        self._used.discard(row)
        self._free_rows.append(row)

    def check_fits(self, end: int) -> None:
        """KVOutOfMemoryError unless a request's positions up to ``end`` (exclusive) fit a row of the table."""
        if end > self.max_context_len:
            raise KVOutOfMemoryError(
                f"request needs {end} positions but the table holds {self.max_context_len} per request"
            )

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.check_fits(start + slots.numel())
        self.table[row, start : start + slots.numel()] = slots

    def write_next(self, rows: Sequence[int], positions: Sequence[int], slots: torch.Tensor) -> None:
        """``table[rows[i], positions[i]] = slots[i]`` for every i: one position of each of several rows (the
        caller checks ``check_fits`` before it allocates)."""
        self.table[list(rows), list(positions)] = slots.to(self.table.device)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.table[row, start:end]
