"""``radixserve serve --dp N``: N workers and a router on one machine.

The workers are ordinary ``radixserve serve`` processes (``python -m runtime.cli serve``) on the first N ports
after PORT that are free on 127.0.0.1 (PORT+1 .. PORT+N unless one is taken; the launcher holds them until the
workers listen); the router takes PORT on the host the user asked for. With the exact policy each worker also
publishes its cache events on the next free ports after those. The model is resolved (and the default model
converted) once, before any worker starts, so N workers never race to convert it. On CPU each worker gets an
equal share of the cores unless --num-threads says otherwise (with --tp M each worker's ranks split that share
again). On CUDA worker i sees only its own GPUs (``CUDA_VISIBLE_DEVICES``): GPU i with --tp 1, GPUs i*M ..
i*M+M-1 with --tp M, so its ranks' GPUs 0..M-1 are the machine's i*M + r. With --tp M > 1 fewer than N*M visible
GPUs is a start-up error (two ranks would share a GPU, each sizing its KV pool from the same free memory); with
--tp 1 and fewer than N GPUs the workers share them, as before.

Each worker runs in its own process group (a terminal's Ctrl-C reaches only this process, which then
stops the workers in order) and dies with this process (PR_SET_PDEATHSIG) if it is killed outright.
If any worker fails to start, the others are stopped and the exit status is 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType
from typing import Any

import httpx

from router.config import API_KEY_ENV, RouterArgs
from runtime.config import ServerArgs, default_num_threads

logger = logging.getLogger(__name__)
START_TIMEOUT = 900.0
# Flags the launcher sets per worker.
# api_key reaches the workers through the environment, never on a command line other users can read
PER_WORKER = ("model", "host", "port", "kv_events_port", "served_model_name", "num_threads", "api_key")


class PortReservation:
    """The first ``count`` ports above ``base`` that 127.0.0.1 can bind now, held until the workers listen.

    A port already taken (another server, or a client connection's local port in the ephemeral range) would
    make a worker fail at start, so it is skipped instead of assuming PORT+1.. are free. A worker binds its
    port only after loading the model, seconds later; a port merely checked could meanwhile become some
    connection's local port. Each chosen port therefore stays bound here (not listening) until ``close``: the
    kernel hands out no port that has a bound socket, and SO_REUSEADDR, set after the check, lets the worker's
    own listener (uvicorn, ZMQ: both set SO_REUSEADDR) bind it beside this holder. The check is a bind without
    SO_REUSEADDR, so another launcher's held ports count as taken."""

    def __init__(self, base: int, count: int) -> None:
        self.ports: list[int] = []
        self._held: list[socket.socket] = []
        port = base
        while len(self.ports) < count:
            port += 1
            if port > 65535:
                self.close()
                raise OSError(f"fewer than {count} free ports above {base}")
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._held.append(s)
            self.ports.append(port)

    def close(self) -> None:
        """Stop holding the ports (once the workers listen on them, or when the launch is given up)."""
        for s in self._held:
            s.close()
        self._held.clear()


def worker_argv(args: ServerArgs, *, model: str, port: int, served: str, num_threads: int | None,
                kv_events_port: int | None) -> list[str]:
    """The ``serve`` command line of one worker: the user's non-default flags plus the per-worker ones."""
    argv = [sys.executable, "-m", "runtime.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", served]
    if num_threads is not None:
        argv += ["--num-threads", str(num_threads)]
    if kv_events_port is not None:
        argv += ["--kv-events-port", str(kv_events_port)]
    for f in dataclasses.fields(ServerArgs):
        if f.name in PER_WORKER:
            continue
        value = getattr(args, f.name)
        if value is None or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_gpus(dp: int, tp: int, count: int, visible: str | None) -> list[str] | None:
    """Each worker's ``CUDA_VISIBLE_DEVICES`` (None: leave the environment as it is). ``count`` GPUs are
    visible to this process, named by ``visible`` (its own ``CUDA_VISIBLE_DEVICES``) when set. ValueError
    when the workers' tensor-parallel ranks would have to share GPUs."""
    need = dp * tp
    if count == 0 or dp == 1:
        return None  # no GPU, or one worker: its ranks take GPUs 0..tp-1 of what it sees
    if count < need:
        if tp > 1:
            raise ValueError(f"--dp {dp} --tp {tp} needs {need} GPUs (one per rank), {count} visible")
        return None  # --tp 1: the workers share the GPUs
    names = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if len(names) < need:
        names = [str(g) for g in range(count)]
    return [",".join(names[i * tp : (i + 1) * tp]) for i in range(dp)]


def _visible_gpus(args: ServerArgs) -> int:
    if args.device == "cpu":
        return 0
    try:
        import torch

        return int(torch.cuda.device_count())
    except ImportError:
        return 0


def _worker_env(args: ServerArgs, gpus: list[str] | None, i: int) -> dict[str, str]:
    env = dict(os.environ)
    if args.api_key:
        env[API_KEY_ENV] = args.api_key
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus[i]
    return env


class _Interrupted(Exception):
    pass


def _stop_all(procs: list[subprocess.Popen[Any]], timeout: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _wait_healthy(procs: list[subprocess.Popen[Any]], urls: list[str], timeout: float) -> None:
    pending = dict(zip(urls, procs))
    deadline = time.time() + timeout
    while pending:
        for url, p in list(pending.items()):
            if p.poll() is not None:
                raise RuntimeError(f"the worker for {url} exited with status {p.returncode} while starting")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    del pending[url]
                    logger.info("worker %s is ready", url)
            except httpx.HTTPError:
                pass
        if time.time() > deadline:
            raise RuntimeError(f"workers did not start within {timeout:.0f} s: {', '.join(pending)}")
        if pending:
            time.sleep(0.5)


def launch_dp(server_args: ServerArgs, dp: int, router_args: RouterArgs | None = None,
              start_timeout: float = START_TIMEOUT) -> int:
    """Start ``dp`` workers configured by ``server_args`` and a router on ``server_args.port``; run until
    SIGINT/SIGTERM. Returns the exit status: 1 if a worker failed to start, else the router's."""
    from router.app import serve_router
    from runtime.launch import served_name
    from runtime.logging_setup import configure_logging
    from runtime.models.folders import resolve_model_path

    configure_logging(server_args.log_level, "dp")
    if dp < 1:
        logger.error("dp: must be >= 1, got %d", dp)
        return 2
    router_args = router_args or RouterArgs(host=server_args.host, port=server_args.port)
    api_key = server_args.api_key or os.environ.get(API_KEY_ENV) or None
    server_args = dataclasses.replace(server_args, api_key=api_key)
    served = served_name(server_args, server_args.model)
    try:
        model = str(resolve_model_path(server_args.model))
    except Exception as exc:  # a bad --model: say so, like a single server would
        logger.error("%s", exc)
        return 1
    threads = server_args.num_threads or max(1, default_num_threads() // dp)
    try:
        gpus = worker_gpus(dp, server_args.tp_size, _visible_gpus(server_args), os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    exact = router_args.policy == "exact"
    try:
        reservation = PortReservation(server_args.port, 2 * dp if exact else dp)
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    ports = reservation.ports
    urls = [f"http://127.0.0.1:{p}" for p in ports[:dp]]
    events = ports[dp:]
    procs: list[subprocess.Popen[Any]] = []

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        raise _Interrupted(signal.Signals(signum).name)

    old = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            for i in range(dp):
                argv = worker_argv(server_args, model=model, port=ports[i], served=served,
                                   num_threads=threads, kv_events_port=events[i] if exact else None)
                logger.info("starting worker %d/%d on %s", i + 1, dp, urls[i])
                procs.append(subprocess.Popen(argv, env=_worker_env(server_args, gpus, i), start_new_session=True,
                                              preexec_fn=_die_with_parent))
            _wait_healthy(procs, urls, start_timeout)
        except (RuntimeError, OSError) as exc:
            logger.error("%s; stopping the workers", exc)
            return 1
        except _Interrupted as exc:
            logger.info("%s while starting; stopping the workers", exc)
            return 1
        finally:
            reservation.close()  # the workers listen on their ports now, or are being stopped
            for s, h in old.items():
                signal.signal(s, h)  # uvicorn installs its own handlers for the router
        router_args = router_args.copy(
            worker_urls=urls, kv_events_endpoints=[f"tcp://127.0.0.1:{p}" for p in events], api_key=api_key)
        logger.info("%d workers ready; router on %s:%d (policy %s)", dp, router_args.host, router_args.port,
                    router_args.policy)
        return serve_router(router_args)
    finally:
        _stop_all(procs)
