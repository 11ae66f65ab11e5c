"""Start and stop the server: child processes first, the HTTP port only once the model is loaded.

Processes start with ``spawn``. Each child reports readiness (or its error) on a private socket; the
port opens after both are ready. SIGINT/SIGTERM stop uvicorn, then the children are terminated. If a
child dies, pending and new requests get 503 and the server exits with status 1. Children die with
the parent (PR_SET_PDEATHSIG) and also notice a vanished parent on their own, so none is orphaned.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from runtime.config import ServerArgs
from runtime.logging_setup import configure_logging
from runtime.server.ipc import Endpoints, ProcessReady, decode, pull

logger = logging.getLogger(__name__)
READY_TIMEOUT = 900.0
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def served_name(args: ServerArgs, original_model: str) -> str:
    if args.served_model_name:
        return args.served_model_name
    if original_model.lower() in ("default", "smollm2"):
        return DEFAULT_SERVED_NAME
    name = Path(original_model).name
    return name[:-5] if name.lower().endswith(".gguf") else name


class Children:
    def __init__(self, args: ServerArgs, endpoints: Endpoints):
        from runtime.server.detokenizer_process import run_detokenizer_process
        from runtime.server.scheduler_process import run_scheduler_process

        ctx = mp.get_context("spawn")
        me = os.getpid()
        self.procs = {
            "scheduler": ctx.Process(target=run_scheduler_process, args=(args, endpoints, me),
                                     name="radixserve-scheduler"),
            "detokenizer": ctx.Process(target=run_detokenizer_process, args=(args, endpoints, me),
                                       name="radixserve-detokenizer"),
        }

    def start(self) -> None:
        for p in self.procs.values():
            p.start()

    def gone(self) -> str | None:
        for name, p in self.procs.items():
            if not p.is_alive():
                return f"the {name} process exited (code {p.exitcode})"
        return None

    def wait_ready(self, sock: zmq.Socket, timeout: float = READY_TIMEOUT) -> dict[str, dict[str, Any]]:
        infos: dict[str, dict[str, Any]] = {}
        deadline = time.time() + timeout
        while len(infos) < len(self.procs):
            if time.time() > deadline:
                raise RuntimeError(f"the server processes did not start within {timeout:.0f} s")
            if sock.poll(200):
                msg: ProcessReady = decode(sock.recv())
                if msg.error:
                    raise RuntimeError(f"the {msg.name} process failed to start: {msg.error}")
                infos[msg.name] = msg.info
                continue
            reason = self.gone()
            if reason:
                raise RuntimeError(reason)
        return infos

    def stop(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(2)


def launch_server(args: ServerArgs) -> int:
    """Run the server until it is stopped; returns the process exit status."""
    from runtime.http.app import create_app
    from runtime.http.uvicorn_server import make_server, run_until_stopped
    from runtime.models.loader import resolve_model_path
    from runtime.server.tokenizer_manager import TokenizerManager

    configure_logging(args.log_level, "server")
    original_model = args.model
    args = args.resolve()
    # Resolve (and convert, with a progress bar) the model once, before any child starts.
    args.model = str(resolve_model_path(args.model))
    endpoints, ipc_dir = Endpoints.create()
    zctx = zmq.Context()
    ready = pull(zctx, endpoints.ready)
    children = Children(args, endpoints)
    status = {"code": 0}
    try:
        logger.info("starting the scheduler and detokenizer processes for %s", args.model)
        children.start()
        infos = children.wait_ready(ready)
        ready.close()
        info = infos["scheduler"]
        logger.info("model ready: %s (%s, %s on %s), KV pool %d tokens, context %d", info["architecture"],
                    Path(info["model_path"]).name, info["dtype"], info["device"], info["max_total_tokens"],
                    info["context_length"])
        tm = TokenizerManager(args, endpoints, info)
        server: Any = None

        def fatal() -> None:
            status["code"] = 1
            if server is not None:
                server.should_exit = True

        app = create_app(tm, served_name(args, original_model), children.gone, fatal)
        server = make_server(app, args.host, args.port, args.log_level)
        if not run_until_stopped(server):
            status["code"] = status["code"] or 1
        return status["code"]
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        children.stop()
        zctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        sys.stdout.flush()
