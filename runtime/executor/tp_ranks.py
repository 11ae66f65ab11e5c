"""Tensor-parallel ranks 1..N-1: their process (``run_rank``) and rank 0's side of them (``RankGroup``).

Start-up, in order, so that every failure is seen by polling rather than inside a collective:

1. Rank 0 opens a TCP store on a free loopback port and a supervisor thread spawns the ranks. The thread
   that spawns a child must outlive it: ``die_with_parent`` (PR_SET_PDEATHSIG) fires when the *thread*
   that started the child ends, and the Engine builds its runner on a short-lived thread.
2. Every rank builds its shard (weights, ops); rank 0 then sizes the KV pool and publishes the slot count
   and request-table shape in the store; each rank allocates its KV shard and publishes ``ready``.
3. Rank 0 waits for every ``ready`` while watching the processes: a rank that exits or reports an error
   becomes ``RankStartError`` naming it. Then all ranks build the process group (gloo / NCCL).

Steady state: each step rank 0 broadcasts the batch (``tp_step``), all ranks run their shard, rank 0
gathers the logits; between steps rank 0 may announce a copy of KV pages to or from the host or disk tier
(``tp_kv``), in which every rank takes part. A rank that dies fails rank 0's next collective at once (its
socket closes); the supervisor notices it even when the server is idle: inside a server's scheduler process
(a spawned child) it logs which rank died and exits the process with status 1, so the launcher answers 503
and exits; in a user's own process (the Engine) the failure is raised by the next forward instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any

import torch
import torch.distributed as dist

from radix.kv_storage import KVStorage
from runtime.config import ServerArgs
from runtime.distributed.comm import TPComm, make_process_group
from runtime.executor.model_build import build_model, kv_shape, model_source, tp_shards
from runtime.executor.tp_kv import HeadLayout, serve_kv_copy
from runtime.executor.tp_step import KVCopy, recv_op
from runtime.logging_setup import configure_logging
from runtime.models.tp_plan import TPContext

logger = logging.getLogger(__name__)

START_TIMEOUT = 600.0  # seconds a rank may take to load its shard
HOST = "127.0.0.1"


class RankStartError(RuntimeError):
    """A tensor-parallel rank failed to start."""


class RankFailure(RuntimeError):
    """A tensor-parallel rank died while serving."""


@dataclass
class RankSpec:
    args: ServerArgs  # resolved
    rank: int
    size: int
    store_port: int
    threads: int
    device: str


@dataclass
class MemorySpec:
    total_slots: int
    page_size: int
    table_rows: int
    table_cols: int


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU (NCCL needs one device per rank); the CPU for every rank on CPU."""
    return torch.device("cuda", (base.index or 0) + rank) if base.type == "cuda" else base


def exit_text(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _die_with_parent() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when ranks stop
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_rank(spec: RankSpec) -> None:
    """Process entry of ranks 1..N-1: build the shard, then run every step rank 0 broadcasts until STOP."""
    _die_with_parent()
    configure_logging(spec.args.log_level, f"tp-rank-{spec.rank}")
    torch.set_num_threads(spec.threads)
    timeout = datetime.timedelta(seconds=START_TIMEOUT)
    store = dist.TCPStore(HOST, spec.store_port, spec.size, False, timeout=timeout)
    args, device = spec.args, torch.device(spec.device)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        source = model_source(args)
        comm = TPComm(spec.rank, spec.size, args.enable_deterministic_inference)
        tp = TPContext.for_rank(tp_shards(source.hf_config, spec.size), comm)
        model, _backend = build_model(args, source, device, tp)
        mem = MemorySpec(**json.loads(store.get("memory")))
        kv = KVStorage(kv_shape(args, model), mem.total_slots, mem.page_size, device)
        table = torch.zeros(mem.table_rows, mem.table_cols, dtype=torch.int64, device=device)
        store.set(f"ready/{spec.rank}", "1")
    except BaseException as exc:
        logger.error("tensor-parallel rank %d failed to start:\n%s", spec.rank, traceback.format_exc())
        store.set(f"error/{spec.rank}", f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    comm.connect(make_process_group(store, spec.rank, spec.size, device))
    layout = HeadLayout.from_shards(tp.shards)
    with torch.inference_mode():
        while (op := recv_op(comm, kv, table)) is not None:
            if isinstance(op, KVCopy):  # the memory hierarchy moving pages between the device and a lower tier
                serve_kv_copy(comm, kv, layout, op)
                continue
            hidden = model.forward(op.batch)
            if op.logit_rows.numel():
                model.compute_logits(hidden.index_select(0, op.logit_rows))
    logger.debug("tensor-parallel rank %d stops", spec.rank)


class RankGroup:
    """Rank 0's view of ranks 1..N-1: spawns them, waits for them, watches them, stops them."""

    def __init__(self, args: ServerArgs, size: int, base_device: torch.device, threads: int):
        self.size = size
        self.store = dist.TCPStore(HOST, 0, size, True, timeout=datetime.timedelta(seconds=START_TIMEOUT),
                                   wait_for_workers=False)
        self.specs = [RankSpec(args, r, size, self.store.port, threads, str(rank_device(base_device, r)))
                      for r in range(1, size)]
        # Inside a server's scheduler process (itself a spawned child) a dead rank ends the process; in a
        # user's process (the Engine) the next forward raises instead.
        self.exit_on_failure = mp.parent_process() is not None
        self.procs: list[Any] = []
        self.failure: str | None = None
        self._serving = False
        self._closing = threading.Event()
        self._stop_r, self._stop_w = mp.Pipe(duplex=False)
        self._spawned = threading.Event()
        self._spawn_error: BaseException | None = None
        self._thread = threading.Thread(target=self._supervise, name="radixserve-tp-supervisor", daemon=True)
        self._thread.start()
        self._spawned.wait()
        if self._spawn_error is not None:
            raise RankStartError(f"could not start the tensor-parallel ranks: {self._spawn_error}")

    # ------------------------------------------------------------------ start-up
    def publish_memory(self, mem: MemorySpec) -> None:
        self.store.set("memory", json.dumps(mem.__dict__))

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until every rank has its shard and KV; :class:`RankStartError` naming a rank that failed."""
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.size))
        while pending:
            for r in sorted(pending):
                if self.store.check([f"error/{r}"]):
                    raise RankStartError(f"tensor-parallel rank {r} failed to start: "
                                         f"{self.store.get(f'error/{r}').decode()}")
                if self.store.check([f"ready/{r}"]):
                    pending.discard(r)
                elif not self.procs[r - 1].is_alive():
                    p = self.procs[r - 1]
                    p.join(1)
                    raise RankStartError(f"tensor-parallel rank {r} (pid {p.pid}) {exit_text(p.exitcode)} "
                                         "while starting")
            if pending and time.monotonic() > deadline:
                raise RankStartError(f"tensor-parallel ranks {sorted(pending)} did not start within {timeout:.0f} s")
            time.sleep(0.05)

    def connect(self, comm: TPComm, device: torch.device) -> None:
        comm.connect(make_process_group(self.store, 0, self.size, device))
        self._serving = True

    @property
    def connected(self) -> bool:
        return self._serving

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    # ------------------------------------------------------------------ supervision
    def _supervise(self) -> None:
        try:
            ctx = mp.get_context("spawn")
            for spec in self.specs:
                p = ctx.Process(target=run_rank, args=(spec,), name=f"radixserve-tp-rank-{spec.rank}")
                p.start()
                self.procs.append(p)
        except BaseException as exc:
            self._spawn_error = exc
        finally:
            self._spawned.set()
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
        # This thread returns only once close() has seen every rank exit: its end would SIGKILL them.
        while True:
            ready = wait_any([self._stop_r, *sentinels])
            if self._stop_r in ready:
                return
            for s in ready:
                r = sentinels.pop(s)
                p = self.procs[r - 1]
                p.join(1)  # the sentinel fires as the process ends; reap it for its exit code
                if not self._closing.is_set():
                    self._rank_died(r, p.pid, p.exitcode)

    def _rank_died(self, rank: int, pid: int | None, code: int | None) -> None:
        self.failure = self.failure or f"tensor-parallel rank {rank} (pid {pid}) {exit_text(code)}"
        if not self._serving:
            return  # start-up: wait_ready reports it
        logger.error("%s", self.failure)
        if self.exit_on_failure:
            self._kill_all()
            logging.shutdown()
            os._exit(1)

    def failure_reason(self, wait: float = 2.0) -> str | None:
        """Which rank died, waiting up to ``wait`` s for the supervisor to see the exit that a failed
        collective already showed."""
        deadline = time.monotonic() + wait
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.failure

    # ------------------------------------------------------------------ stop
    def close(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to exit (they were sent STOP, or died), kill stragglers, end the supervisor."""
        self._closing.set()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        self._stop_w.send(b"")
        self._thread.join(timeout=5)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(2)
