"""``radixserve bench``: run one workload against a URL, compare the systems, regenerate the report, profile,
and write a generated workload to a file.

Imports beyond the (standard-library only) workload generators are deferred to the subcommand that needs
them, so ``radixserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from runtime.bench.servers import SYSTEMS
from runtime.bench.workloads import QUICK_PARAMS
from runtime.bench.workloads import WORKLOADS as GENERATORS

WORKLOADS = tuple(GENERATORS)
FILE_HELP = ("A workload file to run instead of a generated workload: JSON (a workload object or a list of "
             "requests/sessions) or, for *.jsonl, one request or session per line. Format: the docstring of "
             "runtime/bench/workloads.py; `radixserve bench workload NAME --out FILE` writes one.")
QUICK_HELP = ", ".join(f"{name} {' '.join(f'{k}={v}' for k, v in p.items())}" for name, p in QUICK_PARAMS.items())


def add_bench_parser(sub: Any) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    bench = sub.add_parser("bench", help="Benchmarks: prefix-heavy workloads against radixserve and its peers.",
                           description="Benchmarks on four seeded, built-in workloads (few-shot, multi-turn chat, "
                           "parallel sampling, agent loop) or on workload files.")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    run = bsub.add_parser("run", formatter_class=fmt, help="Run one workload against an OpenAI-compatible URL.",
                          description="Run one workload against any OpenAI-compatible server and print throughput, "
                          "TTFT and latency percentiles, errors, and the cache hit rate next to its optimum.")
    run.add_argument("--url", required=True, help="Server URL, with or without /v1 (e.g. http://127.0.0.1:30000).")
    which = run.add_mutually_exclusive_group(required=True)
    which.add_argument("--workload", choices=WORKLOADS, help="Which built-in workload to generate and run.")
    which.add_argument("--workload-file", metavar="PATH", help=FILE_HELP)
    run.add_argument("--quick", action="store_true", help=f"Use the small --quick sizes ({QUICK_HELP}).")
    run.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                     help="Override a workload parameter (repeatable), e.g. questions=16.")
    run.add_argument("--concurrency", type=int, default=8, help="Requests in flight at most.")
    run.add_argument("--n-mode", choices=("native", "expand"), default="native",
                     help="n > 1: one request with n (native) or n requests with n = 1 (for servers that ignore n).")
    run.add_argument("--model", default=None, help="Model name to send (default: the first of GET /v1/models).")
    run.add_argument("--tokenizer", default=None,
                     help="Local tokenizer folder for the optimum (default: the converted default model's).")
    run.add_argument("--no-optimum", action="store_true", help="Skip the optimum hit rate (no tokenizer needed).")
    run.add_argument("--flush-cache", action="store_true",
                     help="POST /flush_cache first (radixserve), so the hit rate covers this run only.")
    run.add_argument("--no-warmup", action="store_true", help="Skip the unmeasured warm-up request.")
    run.add_argument("--disable-stream", action="store_true",
                     help="Send every request unstreamed (one JSON reply each): no TTFT, and the server sends "
                     "nothing per token, so the throughput against a streamed run shows what streaming costs.")
    run.add_argument("--timeout", type=float, default=3600.0, help="Per-request timeout in seconds.")
    run.add_argument("--label", default="target", help="System name to record with the results.")
    run.add_argument("--out", default=None, help="Save the summary and per-request records to this JSON file.")
    run.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")

    cmp = bsub.add_parser("compare", formatter_class=fmt, help="Compare radixserve with its peers in one run.",
                          description="Measure radixserve, radixserve with --disable-radix-cache, naive transformers "
                          "generate and llama.cpp's server (llama-cpp-python; skipped if not installed) on the same "
                          "workloads, save the results and write a report with plots.")
    cmp.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="Systems to measure.")
    cmp.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                     help="Built-in workloads to run.")
    cmp.add_argument("--workload-file", action="append", default=[], metavar="PATH",
                     help="Run this workload file (repeatable) instead of the built-in workloads; see bench run.")
    cmp.add_argument("--quick", action="store_true", help=f"Small workloads ({QUICK_HELP}): minutes instead of "
                     "about an hour.")
    cmp.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                     help="Override a parameter of every workload that has it (repeatable), e.g. max_tokens=16.")
    cmp.add_argument("--out", default=None, help="Results folder (default: bench_results/<date_time>).")
    cmp.add_argument("--concurrency", type=int, default=8, help="Requests in flight at most (HTTP servers).")
    cmp.add_argument("--model", default="default", help="Model for radixserve and transformers (llama.cpp "
                     "always runs the default model's GGUF and is skipped otherwise).")
    cmp.add_argument("--threads", type=int, default=0,
                     help="CPU threads for every system (0: all cores, radixserve's default).")
    cmp.add_argument("--timeout", type=float, default=3600.0, help="Per-request timeout in seconds.")
    cmp.add_argument("--server-args", default="", metavar="FLAGS",
                     help="Extra flags for the radixserve servers, one quoted string (e.g. '--quantization int8' "
                     "to compare the fastest opt-in weight format); the report's command lines show them.")
    cmp.add_argument("--no-profile", action="store_true", help="Skip the in-process step profile at the end.")
    cmp.add_argument("--update-docs", action="store_true",
                     help="Also rewrite the Peer comparison section of docs/benchmarks.md and docs/img/bench_*.png.")
    cmp.add_argument("--no-progress", action="store_true", help="Hide the progress bars.")

    rep = bsub.add_parser("report", formatter_class=fmt, help="Regenerate the report and plots from saved results.",
                          description="Write PNG plots and the Peer comparison section of docs/benchmarks.md from "
                          "a results folder of `radixserve bench compare`.")
    rep.add_argument("results", help="Results folder (holds summary.json and records.jsonl).")
    rep.add_argument("--docs", default=None, help="Page whose marked section is rewritten (default: the "
                     "checkout's docs/benchmarks.md).")
    rep.add_argument("--img-dir", default=None, help="Where the PNGs go (default: img/ beside the page).")
    rep.add_argument("--local", action="store_true",
                     help="Write report.md and img/ inside the results folder instead of the docs.")

    wlp = bsub.add_parser("workload", formatter_class=fmt, help="Generate a built-in workload: sizes or a file.",
                          description="Generate one built-in workload (seeded: the same parameters always give "
                          "the same requests) and print its sizes, or write it as a workload file for "
                          "--workload-file (JSON, or JSON Lines when the name ends in .jsonl).")
    wlp.add_argument("name", choices=WORKLOADS, help="Which workload.")
    wlp.add_argument("--quick", action="store_true", help=f"Use the small --quick sizes ({QUICK_HELP}).")
    wlp.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                     help="Override a workload parameter (repeatable), e.g. seed=3.")
    wlp.add_argument("--out", default=None, help="Write the workload to this file.")

    prof = bsub.add_parser("profile", formatter_class=fmt, help="Time the parts of one scheduler step in-process.",
                           description="Time scheduling, batch building, attention planning, the decoder layers, "
                           "the output projection, sampling and result processing of scheduler steps on a few-shot "
                           "batch, each next to the weight-streaming floor measured in the same run, and a ZMQ round "
                           "trip of 64 outputs.")
    prof.add_argument("--model", default="default", help="Model to load (as radixserve serve --model).")
    prof.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores).")
    prof.add_argument("--batch", type=int, default=8, help="Requests in the batch.")
    prof.add_argument("--decode-steps", type=int, default=16, help="Decode steps timed per repeat.")
    prof.add_argument("--repeats", type=int, default=3, help="Times the scenario is repeated (medians).")
    prof.add_argument("--server-args", default="", metavar="FLAGS",
                      help="radixserve serve flags for the profiled runtime, one quoted string (e.g. '--quantization "
                      "int8'); the weight-streaming floor printed beside each step is that format's.")
    prof.add_argument("--out", default=None, help="Save the profile as JSON.")

    qual = bsub.add_parser("quality", formatter_class=fmt,
                           help="Output quality of bf16 / int8 weights (and the int8 KV"
                           " cache) vs float32.",
                           description="Greedy agreement with float32 over built-in workload prompts and perplexity of "
                           "a shipped text, for each faster weight format (in-process Engines, one at a time).")
    qual.add_argument("--model", default="default", help="Model to load (as radixserve serve --model).")
    qual.add_argument("--formats", nargs="+", default=["bfloat16", "int8"],
                      choices=("bfloat16", "int8", "bfloat16+kv8", "int8+kv8"),
                      help="Formats to compare with float32 (+kv8: with --kv-cache-dtype int8).")
    qual.add_argument("--prompts", type=int, default=64, help="Prompts for the greedy agreement.")
    qual.add_argument("--new-tokens", type=int, default=32, help="Greedy tokens generated per prompt.")
    qual.add_argument("--out", default=None, help="Save the results as JSON.")


def _run(args: argparse.Namespace) -> int:
    from runtime.bench.client import run_workload
    from runtime.bench.metrics import format_summary, summarize
    from runtime.bench.workload_files import load_workload_file
    from runtime.bench.workloads import make_workload, parse_params

    if args.workload_file:
        if args.quick or args.param:
            raise ValueError("--quick and --param apply to the built-in workloads, not to --workload-file")
        wl = load_workload_file(args.workload_file)
    else:
        wl = make_workload(args.workload, args.quick, parse_params(args.param))
    run = run_workload(args.url, wl, concurrency=args.concurrency, n_mode=args.n_mode, model=args.model,
                       timeout=args.timeout, progress=not args.no_progress, label=f"{args.label}/{wl['name']}",
                       warmup=not args.no_warmup, flush=args.flush_cache, stream=not args.disable_stream)
    opt, mismatches = None, None
    if not args.no_optimum:
        from runtime.bench.optimum import PromptTokenizer, optimum_for

        opt, mismatches = optimum_for(run.records, PromptTokenizer.load(args.tokenizer))
    s = summarize(run, args.label, opt, mismatches)
    print(format_summary(s))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"summary": s, "records": [r.to_json() for r in run.records]}, indent=1,
                                  default=str))
        print(f"saved {out}")
    return 1 if s["ok"] == 0 else 0


def _compare(args: argparse.Namespace, argv: list[str]) -> int:
    from runtime.bench.compare import CompareOptions, default_command, run_compare
    from runtime.bench.workloads import parse_params

    opts = CompareOptions(systems=args.systems, workloads=args.workloads, quick=args.quick,
                          out=Path(args.out) if args.out else None, concurrency=args.concurrency, model=args.model,
                          threads=args.threads, timeout=args.timeout, params=parse_params(args.param),
                          server_args=shlex.split(args.server_args),
                          profile=not args.no_profile, update_docs=args.update_docs, progress=not args.no_progress,
                          command=default_command(argv), workload_files=[Path(p) for p in args.workload_file])
    run_compare(opts)
    return 0


def _report(args: argparse.Namespace) -> int:
    from runtime.bench.paths import docs_page
    from runtime.bench.report import generate

    if args.local:
        generate(Path(args.results))
    else:
        generate(Path(args.results), docs=Path(args.docs) if args.docs else docs_page(),
                 img_dir=Path(args.img_dir) if args.img_dir else None)
    return 0


def _workload(args: argparse.Namespace) -> int:
    from runtime.bench.workload_files import dump_workload, workload_sizes
    from runtime.bench.workloads import make_workload, parse_params

    wl = make_workload(args.name, args.quick, parse_params(args.param))
    print(f"{workload_sizes(wl)}; {wl['description']}")
    if args.out:
        print(f"wrote {dump_workload(wl, args.out)}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from runtime.bench.profile import format_profile, run_profile

    p = run_profile(args.model, threads=args.threads or None, batch=args.batch, decode_steps=args.decode_steps,
                    repeats=args.repeats, server_flags=shlex.split(args.server_args))
    print(format_profile(p))
    if args.out:
        Path(args.out).write_text(json.dumps(p, indent=1))
    return 0


def _quality(args: argparse.Namespace) -> int:
    from runtime.bench.quality import measure, report

    rows = report(measure(args.model, args.formats, args.prompts, args.new_tokens))
    print(f"{'format':12} {'prompts':>7} {'identical':>9} {'agreeing':>9} {'perplexity':>10} {'change':>8}")
    for r in rows:
        print(f"{r['name']:12} {r['prompts']:7d} {r['identical']:9.3f} {r['agreeing_tokens']:9.3f} "
              f"{r['perplexity']:10.3f} {100 * r['perplexity_change']:+7.2f}%")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def run_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if args.bench_command == "run":
            return _run(args)
        if args.bench_command == "compare":
            return _compare(args, argv)
        if args.bench_command == "report":
            return _report(args)
        if args.bench_command == "workload":
            return _workload(args)
        if args.bench_command == "quality":
            return _quality(args)
        return _profile(args)
    except (FileNotFoundError, ValueError, ConnectionError) as exc:
        print(f"radixserve bench {args.bench_command}: {exc}", file=sys.stderr)
        return 2
