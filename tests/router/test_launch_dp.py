"""``serve --dp N`` as runtime/cli.py wires it: N workers and a router; a clean stop; a failed start."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from router.launch_dp import PortReservation, worker_argv, worker_gpus
from runtime.config import ServerArgs
from tests.server_harness import ROOT, alive_after, free_port

# The wiring runtime/cli.py uses: ServerArgs flags + add_dp_args on the serve parser, then run_dp.
LAUNCH = ("import argparse, sys\n"
          "from runtime.config import add_server_args, server_args_from_namespace\n"
          "from router.cli import add_dp_args, run_dp\n"
          "p = argparse.ArgumentParser()\n"
          "add_server_args(p)\n"
          "add_dp_args(p)\n"
          "ns = p.parse_args(sys.argv[1:])\n"
          "sys.exit(run_dp(ns, server_args_from_namespace(ns)))\n")


def launch(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCH, "--log-level", "warning", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def test_dp_starts_workers_and_router_and_stops_cleanly(tiny_model_dir: Path) -> None:
    port = free_port()
    proc = launch("--model", str(tiny_model_dir), "--port", str(port), "--dp", "2", "--max-total-tokens", "8192",
                  "--router-policy", "exact")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.3)
        workers = httpx.get(url + "/workers").json()
        assert workers["policy"] == "exact"
        worker_ports = [int(w["url"].rsplit(":", 1)[1]) for w in workers["workers"]]
        assert len(set(worker_ports)) == 2 and all(p > port for p in worker_ports)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        info = httpx.get(url + "/get_server_info", timeout=60).json()
        assert info["dp_size"] == 2 and info["port"] == port
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, proc.stdout.read().decode() if proc.stdout else ""
    assert alive_after(children) == []


def test_worker_ports_skip_a_port_already_taken() -> None:
    """A worker on a port someone else holds would fail at start; the launcher takes the next free one."""
    base = free_port()
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", base + 1))
        except OSError:
            pytest.skip("the port after a free one is already taken here")
        held.listen()
        reservation = PortReservation(base, 3)
    try:
        ports = reservation.ports
        assert base + 1 not in ports and len(set(ports)) == 3 and all(p > base + 1 for p in ports)
        assert ports == sorted(ports)
    finally:
        reservation.close()


def test_reserved_ports_stay_free_for_the_workers_alone() -> None:
    """Between the choice and the worker's listen, the ports stay bound by the launcher: a second launcher (a
    plain bind) skips them, while the worker's own listener (SO_REUSEADDR, as uvicorn and ZMQ bind) gets them."""
    reservation = PortReservation(free_port(), 2)
    try:
        for port in reservation.ports:
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
            with socket.socket() as worker:
                worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                worker.bind(("127.0.0.1", port))
                worker.listen()
        second = PortReservation(reservation.ports[0] - 1, 1)
        assert second.ports[0] not in reservation.ports
        second.close()
    finally:
        reservation.close()
    with socket.socket() as after:  # released: anyone may bind them again
        after.bind(("127.0.0.1", reservation.ports[0]))


def test_dp_exits_nonzero_when_workers_cannot_start(tmp_path: Path) -> None:
    proc = launch("--model", str(tmp_path / "missing"), "--port", str(free_port()), "--dp", "2")
    assert proc.wait(120) != 0


def test_each_worker_sees_its_own_gpus() -> None:
    """``--dp N --tp M`` on CUDA: worker i's CUDA_VISIBLE_DEVICES holds GPUs i*M .. i*M+M-1 (its ranks' GPUs
    0..M-1), by the names this process sees when it was given a list."""
    assert worker_gpus(2, 2, 4, None) == ["0,1", "2,3"]
    assert worker_gpus(2, 2, 8, None) == ["0,1", "2,3"]  # the rest stay free
    assert worker_gpus(2, 3, 6, "5,4,3,2,1,0") == ["5,4,3", "2,1,0"]
    assert worker_gpus(3, 1, 4, "1,3,5,7") == ["1", "3", "5"]
    assert worker_gpus(2, 2, 0, None) is None  # CPU: nothing to divide
    assert worker_gpus(1, 4, 4, None) is None  # one worker: its ranks take what it sees
    assert worker_gpus(3, 1, 2, None) is None  # --tp 1 with fewer GPUs than workers: they share, as before
    with pytest.raises(ValueError, match="--dp 2 --tp 2 needs 4 GPUs \\(one per rank\\), 3 visible"):
        worker_gpus(2, 2, 3, None)


def test_workers_inherit_the_tensor_parallel_size() -> None:
    argv = worker_argv(ServerArgs(tp_size=2), model="m", port=1, served="m", num_threads=1, kv_events_port=None)
    assert argv[argv.index("--tp-size") + 1] == "2"
