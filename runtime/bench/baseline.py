"""The naive baseline: plain transformers ``generate``, one request at a time, in-process, nothing shared.

This is what a user without a serving runtime would write. The per-request work is the shared suite's
``HFRunner`` (``client_bench.py``: tokenization, chat template, greedy or seeded sampling, stop ids, TTFT
from a streamer), so the peers' reference figures and ours come from the same code; this module only
drives it over a workload in the same order the HTTP client would, and turns its records into ours.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from tqdm import tqdm

from runtime.bench.client import RequestRecord, RunResult, count_http_requests
from runtime.bench.workloads import bench_dir


def load_client_bench() -> ModuleType:
    """The shared ``client_bench.py``; it imports its neighbours (``workloads``, ``smol_model``) by name,
    so its folder goes on ``sys.path`` first."""
    folder = bench_dir()
    path = folder / "client_bench.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; set RADIXSERVE_BENCH_DIR to the shared bench folder")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    cached = sys.modules.get("radixserve_shared_client_bench")
    if cached is not None:
        return cached
    spec = importlib.util.spec_from_file_location("radixserve_shared_client_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class NaiveTransformers:
    """``model.generate`` per request (fp32, ``threads`` torch threads, KV cache within a request only)."""

    def __init__(self, model_dir: str | Path, threads: int = 2, dtype: str = "fp32"):
        cb = load_client_bench()
        t0 = time.perf_counter()
        self.runner = cb.HFRunner(str(model_dir), dtype, threads)
        self.load_s = time.perf_counter() - t0
        self.model_dir = str(model_dir)
        self.threads = threads
        self.dtype = dtype

    @property
    def target(self) -> str:
        return f"transformers generate, sequential ({self.dtype}, {self.threads} threads, {self.model_dir})"

    def warmup(self) -> None:
        self.runner.send("warmup", "completions", {"prompt": "Warm-up request.", "max_tokens": 4,
                                                   "temperature": 0.0})
        self.runner.records.clear()

    def _send(self, rid: str, endpoint: str, body: dict[str, Any], t0: float) -> RequestRecord:
        r = self.runner.send(rid, endpoint, body)
        rec = RequestRecord(rid, endpoint, body, max(int(body.get("n", 1) or 1), 1))
        rec.sent_at = r.start - t0
        rec.first_token_at = None if r.ttft is None else r.ttft - t0
        rec.done_at = None if r.end is None else r.end - t0
        rec.texts = dict(r.texts)
        rec.chunks = r.chunks
        rec.output_tokens = r.usage_out
        rec.prompt_tokens = r.usage_in
        rec.error = r.error
        return rec

    def run(self, wl: dict[str, Any], progress: bool = True, label: str = "") -> RunResult:
        records: list[RequestRecord] = []
        bar = tqdm(total=count_http_requests(wl, "native"), desc=label or wl["name"], unit="req",
                   disable=not progress, dynamic_ncols=True)
        t0 = time.perf_counter()
        try:
            if wl["kind"] == "independent":
                for req in wl["requests"]:
                    records.append(self._send(req["id"], req["endpoint"], req["body"], t0))
                    bar.update(1)
            else:
                for sess in wl["sessions"]:
                    history = copy.deepcopy(sess["messages"])
                    for i, step in enumerate(sess["steps"]):
                        history = history + copy.deepcopy(step["append"])
                        rec = self._send(f"{sess['id']}/{i}", "chat", dict(step["body"], messages=history), t0)
                        records.append(rec)
                        bar.update(1)
                        if not rec.ok:
                            bar.update(len(sess["steps"]) - i - 1)
                            break
                        history = history + [{"role": "assistant", "content": rec.texts.get(0, "")}]
            wall = time.perf_counter() - t0
        finally:
            bar.close()
        self.runner.records.clear()
        return RunResult(wl["name"], dict(wl["params"]), wl.get("description", ""), self.target, records, wall)
