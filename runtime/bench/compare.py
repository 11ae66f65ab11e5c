"""The comparison runner: every system on the same workloads, one machine, one run.

Workloads are the generators of ``workloads.py`` (or the files given with ``--workload-file``).

Systems, each measured on the same requests with the same ``max_tokens`` (greedy where the workload says):

- ``radixserve``: ``radixserve serve`` on a free port, the default model;
- ``radixserve-nocache``: the same server restarted with ``--disable-radix-cache``;
- ``transformers``: ``generate`` in-process, one request at a time, fp32, the same converted model folder;
- ``llamacpp``: llama-cpp-python's server on the same model's GGUF (skipped, with the reason, when the
  package is missing; ``n > 1`` is sent as ``n`` requests since it ignores ``n``).

Servers get one unmeasured warm-up request and, when they have ``/flush_cache``, an empty cache before
each workload, so every workload starts cold. Results go to ``--out`` (``bench_results/<date>``):
``results.jsonl`` (one summary per system and workload), ``records.jsonl`` (one line per request),
``summary.json`` (machine, commands, systems' status, results, step profile) and a report with plots.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runtime.bench.client import RunResult, run_workload
from runtime.bench.metrics import format_summary, summarize
from runtime.bench.optimum import PromptTokenizer, optimum_for
from runtime.bench.paths import REPO, default_results_root, docs_page, portable_command
from runtime.bench.servers import SYSTEMS
from runtime.bench.workload_files import load_workload_file
from runtime.bench.workloads import WORKLOADS as GENERATORS
from runtime.bench.workloads import make_workload

WORKLOADS = tuple(GENERATORS)


@dataclass
class CompareOptions:
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    quick: bool = False
    out: Path | None = None
    concurrency: int = 8
    model: str = "default"
    threads: int = 0  # 0: all cores (radixserve's default), also used for transformers and llama.cpp
    server_args: list[str] = field(default_factory=list)  # extra flags for both radixserve servers
    timeout: float = 3600.0
    params: dict[str, Any] = field(default_factory=dict)  # workload overrides (applied to every workload)
    workload_files: list[Path] = field(default_factory=list)  # measured instead of the generated workloads
    profile: bool = True
    update_docs: bool = False
    progress: bool = True
    command: str = ""


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        mem_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration):
        pass
    info: dict[str, Any] = {
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "os": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_start": os.getloadavg(),
    }
    try:
        import subprocess

        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except OSError:
        info["commit"] = None
    return info


class Comparison:
    def __init__(self, opts: CompareOptions):
        self.opts = opts
        self.out = Path(opts.out or default_results_root() / time.strftime("%Y-%m-%d_%H%M%S"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = self.out / "logs"
        self.threads = opts.threads or len(os.sched_getaffinity(0))
        self.workloads = load_workloads(opts)
        self.summary: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": opts.command, "quick": opts.quick,
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
            "workloads": {n: {"params": w["params"], "description": w["description"], "source": w.get("source")}
                          for n, w in self.workloads.items()},
            "systems": {}, "results": [], "profile": None,
        }
        self._tokenizer: PromptTokenizer | None = None

    # ------------------------------------------------------------------ bookkeeping
    @property
    def tokenizer(self) -> PromptTokenizer:
        if self._tokenizer is None:
            from runtime.models.folders import resolve_model_path

            self._tokenizer = PromptTokenizer.load(resolve_model_path(self.opts.model))
        return self._tokenizer

    def _save(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))

    def _record(self, system: str, run: RunResult) -> dict[str, Any]:
        opt, mismatches = optimum_for(run.records, self.tokenizer)
        s = summarize(run, system, opt, mismatches)
        print(format_summary(s), flush=True)
        self.summary["results"].append(s)
        with open(self.out / "results.jsonl", "a") as f:
            f.write(json.dumps(s, default=str) + "\n")
        with open(self.out / "records.jsonl", "a") as f:
            for r in run.records:
                f.write(json.dumps({"system": system, "workload": run.workload, **r.to_json()}) + "\n")
        self._save()
        return s

    # ------------------------------------------------------------------ systems
    def _run_server(self, name: str, make: Callable[[], Any], n_mode: str, flush: bool) -> None:
        server = make()
        self.summary["systems"][name] = {"status": "starting", "command": portable_command(server.cmd),
                                         "n_mode": n_mode}
        with server:
            for wl_name, wl in self.workloads.items():
                run = run_workload(server.url, wl, concurrency=self.opts.concurrency, n_mode=n_mode,
                                   timeout=self.opts.timeout, progress=self.opts.progress,
                                   label=f"{name}/{wl_name}", warmup=True, flush=flush)
                run.target = f"{name} ({run.target})"
                self._record(name, run)
        self.summary["systems"][name]["status"] = "ok"

    def _run_transformers(self) -> None:
        from runtime.bench.baseline import NaiveTransformers
        from runtime.models.folders import resolve_model_path

        hf = NaiveTransformers(resolve_model_path(self.opts.model), threads=self.threads)
        self.summary["systems"]["transformers"] = {
            "status": "starting", "command": f"in-process: {hf.target} (runtime/bench/baseline.py)",
            "load_s": round(hf.load_s, 2)}
        hf.warmup()
        for wl_name, wl in self.workloads.items():
            self._record("transformers", hf.run(wl, progress=self.opts.progress, label=f"transformers/{wl_name}"))
        self.summary["systems"]["transformers"]["status"] = "ok"

    def run_system(self, name: str) -> None:
        from runtime.bench import servers

        extra = ["--num-threads", str(self.opts.threads)] if self.opts.threads else []
        extra += self.opts.server_args
        print(f"\n##### {name}", flush=True)
        if name in ("radixserve", "radixserve-nocache"):
            self._run_server(name, lambda: servers.radixserve_server(
                self.logs, self.opts.model, radix_cache=name == "radixserve", extra=extra), "native", flush=True)
        elif name == "transformers":
            self._run_transformers()
        elif name == "llamacpp":
            ok, why = servers.llama_cpp_status()
            if not ok:
                print(f"llama.cpp server: skipped ({why})", flush=True)
                self.summary["systems"][name] = {"status": "skipped", "reason": why}
                return
            if self.opts.model != "default":
                why = "llama.cpp runs the default model's GGUF only; --model is not the default"
                print(f"llama.cpp server: skipped ({why})", flush=True)
                self.summary["systems"][name] = {"status": "skipped", "reason": why}
                return
            self._run_server(name, lambda: servers.llama_cpp_server(self.logs, self.threads), "expand", flush=False)
            self.summary["systems"][name]["version"] = why
        else:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")

    # ------------------------------------------------------------------ the whole run
    def run(self) -> Path:
        self.summary["machine"] = machine_info()
        print(f"results -> {self.out}", flush=True)
        t0 = time.perf_counter()
        for name in self.opts.systems:
            try:
                self.run_system(name)
            except Exception as exc:  # one system failing must not lose the others' results
                print(f"{name}: FAILED: {exc}", file=sys.stderr, flush=True)
                entry = self.summary["systems"].setdefault(name, {})
                entry.update(status="failed", reason=str(exc)[:2000], traceback=traceback.format_exc()[-4000:])
            self._save()
        if self.opts.profile and "radixserve" in self.opts.systems:
            from runtime.bench.profile import format_profile, run_profile

            print("\n##### step profile (in-process)", flush=True)
            try:
                self.summary["profile"] = run_profile(self.opts.model, threads=self.threads,
                                                      server_flags=self.opts.server_args)
                print(format_profile(self.summary["profile"]), flush=True)
            except Exception as exc:
                print(f"step profile failed: {exc}", file=sys.stderr, flush=True)
        self.summary["machine"]["load_average_end"] = os.getloadavg()
        self.summary["duration_s"] = round(time.perf_counter() - t0, 1)
        self._save()
        from runtime.bench.report import generate

        generate(self.out)  # report.md + img/ inside the results folder
        if self.opts.update_docs:
            page = docs_page()
            generate(self.out, docs=page, img_dir=page.parent / "img")
        print(f"\ndone in {self.summary['duration_s'] / 60:.1f} min; results and report in {self.out}", flush=True)
        return self.out


def load_workloads(opts: CompareOptions) -> dict[str, dict[str, Any]]:
    """The workloads of a comparison: the files of ``--workload-file`` if any, else the generated ones."""
    if not opts.workload_files:
        return {name: make_workload(name, opts.quick, opts.params, strict=False) for name in opts.workloads}
    out: dict[str, dict[str, Any]] = {}
    for path in opts.workload_files:
        wl = load_workload_file(path)
        if wl["name"] in out:
            raise ValueError(f"two workload files are named {wl['name']!r}; give them different names")
        out[wl["name"]] = wl
    return out


def run_compare(opts: CompareOptions) -> Path:
    unknown = [s for s in opts.systems if s not in SYSTEMS] + [w for w in opts.workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown systems/workloads {unknown}; systems: {SYSTEMS}, workloads: {WORKLOADS}")
    if opts.workload_files and (opts.quick or opts.params):
        raise ValueError("--quick and --param apply to the built-in workloads, not to --workload-file")
    if opts.update_docs:
        docs_page()  # fail now, not after an hour of measuring, when there is no page to update
    return Comparison(opts).run()


def default_command(argv: list[str]) -> str:
    """The command as typed, for the report: ``radixserve`` and its arguments, paths made portable."""
    return portable_command(["radixserve", *argv])
