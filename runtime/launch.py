"""Start and stop the server: child processes first, the HTTP port only once the model is loaded.

Processes start with ``spawn``. Each child reports readiness (or its error) on a private socket; the
detokenizer loads its tokenizer once the scheduler has named the tokenizer's class, and the port opens
after both are ready. SIGINT/SIGTERM stop uvicorn, then the children are terminated. If a
child dies, pending and new requests get 503 and the server exits with status 1. Children die with
the parent (PR_SET_PDEATHSIG) and also notice a vanished parent on their own, so none is orphaned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import zmq

from runtime.config import ServerArgs
from runtime.logging_setup import configure_logging
from runtime.server.ipc import Endpoints, ProcessReady, TokenizerChoice, decode, encode, pull, push

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
    """The scheduler and the detokenizer processes. Once the scheduler is ready, the detokenizer and this
    process load the tokenizer class the scheduler's ``AutoTokenizer`` picked, which spares each of them the
    model config's import chain (seconds of CPU that would otherwise compete with the model load)."""

    def __init__(self, endpoints: Endpoints):
        self.endpoints = endpoints
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, BaseProcess] = {}

    def start_scheduler(self, args: ServerArgs) -> None:
        from runtime.server.scheduler_process import run_scheduler_process

        self._start("scheduler", run_scheduler_process, args)

    def start_detokenizer(self, args: ServerArgs) -> None:
        from runtime.server.detokenizer_process import run_detokenizer_process

        self._start("detokenizer", run_detokenizer_process, args)

    def _start(self, name: str, target: Callable[..., None], args: ServerArgs) -> None:
        proc = self.ctx.Process(target=target, args=(args, self.endpoints, os.getpid()),
                                name=f"radixserve-{name}")
        proc.start()
        self.procs[name] = proc

    def gone(self) -> str | None:
        for name, p in self.procs.items():
            if not p.is_alive():
                return f"the {name} process exited (code {p.exitcode})"
        return None

    def wait_ready(self, sock: zmq.Socket, name: str, timeout: float = READY_TIMEOUT) -> ProcessReady:
        """What the started child ``name`` reports once it is ready; raises if it fails or any child dies."""
        deadline = time.time() + timeout
        while True:
            if time.time() > deadline:
                raise RuntimeError(f"the {name} process did not start within {timeout:.0f} s")
            if sock.poll(200):
                msg: ProcessReady = decode(sock.recv())
                if msg.error:
                    raise RuntimeError(f"the {msg.name} process failed to start: {msg.error}")
                if msg.name == name:
                    return msg
                continue
            reason = self.gone()
            if reason:
                raise RuntimeError(reason)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.is_alive() and p.pid is not None:
                p.terminate()
                # a stopped child (SIGSTOP, a debugger) acts on SIGTERM only once continued; else it costs the
                # whole grace period below and then a SIGKILL
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
        for p in self.procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(2)


def import_grammar_engine() -> None:
    """The HTTP side validates grammars with xgrammar, which loads torch: about two seconds that would stall
    the event loop at the first request with a grammar. Run while the model loads, on this process's main
    thread: it has nothing else to do then, and a second importing thread races CPython 3.11's AST compiler
    (which anyio's lazy importer calls), failing the start at random."""
    import xgrammar  # noqa: F401

    import runtime.constrained.grammar  # noqa: F401


def launch_server(args: ServerArgs) -> int:
    """Run the server until it is stopped; returns the process exit status."""
    from runtime.models.folders import resolve_model_path

    configure_logging(args.log_level, "server")
    original_model = args.model
    # Resolve (and convert, with a progress bar) the model once, before any child starts. The 'auto' values
    # are the scheduler's to make concrete: it imports torch anyway, and this process then needs not.
    args = dataclasses.replace(args, model=str(resolve_model_path(args.model)))
    endpoints, ipc_dir = Endpoints.create()
    zctx = zmq.Context()
    ready = pull(zctx, endpoints.ready)
    children = Children(endpoints)
    status = {"code": 0}
    try:
        logger.info("starting the scheduler and detokenizer processes for %s", args.model)
        children.start_scheduler(args)
        children.start_detokenizer(args)
        # the HTTP side's imports (the tokenizer's library and the grammar engine among them) overlap the model load
        import transformers  # noqa: F401

        from runtime.http.app import create_app
        from runtime.http.uvicorn_server import make_server, run_until_stopped
        from runtime.server.tokenizer_manager import TokenizerManager

        import_grammar_engine()

        started = children.wait_ready(ready, "scheduler")
        assert started.args is not None, "the scheduler reports its resolved arguments"
        args, info = started.args, started.info
        to_detokenizer = push(zctx, endpoints.detokenizer)
        to_detokenizer.send(encode(TokenizerChoice(info.get("tokenizer_class"))))
        logger.info("model ready: %s (%s, %s on %s), KV pool %d tokens, context %d", info["architecture"],
                    Path(info["model_path"]).name, info["dtype"], info["device"], info["max_total_tokens"],
                    info["context_length"])
        tm = TokenizerManager(args, endpoints, info)  # loads its tokenizer while the detokenizer loads its own
        children.wait_ready(ready, "detokenizer")
        to_detokenizer.close()  # not before: it lingers for no unsent message
        ready.close()
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
