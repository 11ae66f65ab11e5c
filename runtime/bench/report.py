"""The report of a comparison run: PNG plots and the "Peer comparison" section of docs/benchmarks.md.

Everything is regenerated from a results folder (``summary.json`` + ``records.jsonl``), so the page never
holds a number that is not in a saved run. The section lives between ``<!-- bench:begin -->`` and
``<!-- bench:end -->``; the rest of the page is left as it is.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from runtime.bench.paths import portable_text
from runtime.bench.workloads import SOURCE

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
ORDER = ("radixserve", "radixserve-nocache", "transformers", "llamacpp")
LABELS = {"radixserve": "radixserve", "radixserve-nocache": "radixserve, radix cache off",
          "transformers": "transformers (naive)", "llamacpp": "llama.cpp server"}
COLORS = {"radixserve": "#1f77b4", "radixserve-nocache": "#9ecae1", "transformers": "#ff7f0e",
          "llamacpp": "#2ca02c"}
# (peer, workloads, minimum ratio of radixserve's throughput to the peer's), from the issues. Against llama.cpp's
# server they depend on the weight format radixserve served: the default one must reach 5x on every workload, an
# opt-in one (a --quantization flag, the fastest format) 10x on fewshot and agent.
LLAMACPP_GOALS = {"default": (("fewshot", "multiturn", "parallel", "agent"), 5.0),
                  "opt-in": (("fewshot", "agent"), 10.0)}
OTHER_GOALS = (("transformers", ("fewshot", "agent"), 20.0), ("radixserve-nocache", ("fewshot", "agent"), 3.0))
HIT_GOAL = 0.95  # measured hit rate / optimum
IMAGES = ("bench_throughput.png", "bench_ttft.png", "bench_hit_rate.png")


def load_results(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary = json.loads((folder / "summary.json").read_text())
    records: list[dict[str, Any]] = []
    path = folder / "records.jsonl"
    if path.is_file():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return summary, records


def _num(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    v = _num(x)
    return "n/a" if v is None else format(v, spec) + suffix


def _systems(results: list[dict[str, Any]]) -> list[str]:
    present = {r["system"] for r in results}
    return [s for s in ORDER if s in present] + sorted(present - set(ORDER))


def _workloads(results: list[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for r in results:
        if r["workload"] not in seen:
            seen.append(r["workload"])
    return seen


def _index(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["system"], r["workload"]): r for r in results}


# ---------------------------------------------------------------------- plots
def make_plots(summary: dict[str, Any], records: list[dict[str, Any]], img_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    results = summary["results"]
    systems, workloads, idx = _systems(results), _workloads(results), _index(results)
    tag = " (quick mode)" if summary.get("quick") else ""
    paths = [img_dir / name for name in IMAGES]

    # throughput: grouped bars, log scale (the systems differ by more than an order of magnitude)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / max(len(systems), 1)
    panels = ((axes[0], "sequences_per_s", "sequences / s"), (axes[1], "output_tok_per_s", "output tokens / s"))
    for ax, key, title in panels:
        for j, sysname in enumerate(systems):
            xs, ys = [], []
            for i, wl in enumerate(workloads):
                v = _num(idx.get((sysname, wl), {}).get(key))
                if v:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(v)
            bars = ax.bar(xs, ys, width, label=LABELS.get(sysname, sysname), color=COLORS.get(sysname))
            ax.bar_label(bars, labels=[f"{y:.3g}" for y in ys], fontsize=7, padding=1)
        ax.set_yscale("log")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(f"{title}{tag}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    # TTFT distributions: one box plot per workload, one box per system
    fig, axes = plt.subplots(1, max(len(workloads), 1), figsize=(3.4 * max(len(workloads), 1), 4.2), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        data, names, colors = [], [], []
        for sysname in systems:
            ttfts = [r["ttft_s"] for r in records if r["system"] == sysname and r["workload"] == wl
                     and r.get("error") is None and r.get("ttft_s") is not None]
            if ttfts:
                data.append(ttfts)
                names.append(LABELS.get(sysname, sysname).replace(", ", ",\n").replace(" (", "\n("))
                colors.append(COLORS.get(sysname, "#777777"))
        if data:
            box = ax.boxplot(data, patch_artist=True, whis=(5, 95), showfliers=True)
            for patch, c in zip(box["boxes"], colors):
                patch.set_facecolor(c)
            ax.set_xticks(range(1, len(names) + 1), names, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{wl}: TTFT (s)")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"time to first token per request, whiskers p5-p95{tag}", fontsize=10)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    # hit rate vs optimum
    fig, ax = plt.subplots(figsize=(8, 4))
    series = [(s, "hit_rate", LABELS.get(s, s), COLORS.get(s)) for s in systems
              if any(_num(idx.get((s, w), {}).get("hit_rate")) is not None for w in workloads)]
    series.append(("radixserve", "optimum_hit_rate", "optimum (perfect cache)", "#bbbbbb"))
    width = 0.8 / len(series)
    for j, (sysname, key, label, color) in enumerate(series):
        xs, ys = [], []
        for i, wl in enumerate(workloads):
            row = idx.get((sysname, wl)) or next((r for r in results if r["workload"] == wl), {})
            v = _num(row.get(key))
            if v is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(v)
        bars = ax.bar(xs, ys, width, label=label, color=color)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=1)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylim(0, 1.1)
    ax.set_title(f"prompt tokens served from cache (usage.cached_tokens / prompt_tokens){tag}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------------- markdown
def _ratio(idx: dict[tuple[str, str], dict[str, Any]], peer: str, wl: str) -> float | None:
    mine = _num(idx.get(("radixserve", wl), {}).get("sequences_per_s"))
    theirs = _num(idx.get((peer, wl), {}).get("sequences_per_s"))
    return mine / theirs if mine and theirs else None


def weight_format(summary: dict[str, Any]) -> str:
    """"opt-in" when the radixserve server ran with a --quantization other than none, else "default"."""
    tokens = str(summary.get("systems", {}).get("radixserve", {}).get("command", "")).split()
    value = None
    for i, tok in enumerate(tokens):
        if tok.startswith("--quantization="):
            value = tok.split("=", 1)[1]
        elif tok == "--quantization" and i + 1 < len(tokens):
            value = tokens[i + 1]
    return "opt-in" if value not in (None, "none") else "default"


def throughput_goals(summary: dict[str, Any]) -> list[tuple[str, tuple[str, ...], float]]:
    """The throughput goals that apply to this run: llama.cpp's by the weight format radixserve served."""
    wls, goal = LLAMACPP_GOALS[weight_format(summary)]
    return [("llamacpp", wls, goal), *OTHER_GOALS]


def goal_lines(summary: dict[str, Any]) -> list[str]:
    """One line per goal: met, or missed and by how much."""
    results = summary["results"]
    idx, workloads = _index(results), _workloads(results)
    lines = []
    fmt = weight_format(summary)
    for peer, wls, goal in throughput_goals(summary):
        for wl in wls:
            if wl not in workloads:
                continue
            r = _ratio(idx, peer, wl)
            status = summary.get("systems", {}).get(peer, {}).get("status")
            served = f" ({fmt} weight format)" if peer == "llamacpp" else ""
            what = f"radixserve{served} ≥ {goal:g}x {LABELS[peer]} on {wl}"
            if r is None:
                lines.append(f"- {what}: not measured ({status or 'not run'})")
            elif r >= goal:
                lines.append(f"- {what}: **met** ({r:.1f}x)")
            else:
                lines.append(f"- {what}: **missed** — {r:.1f}x, {100 * (1 - r / goal):.0f}% short of the goal")
    for wl in workloads:
        row = idx.get(("radixserve", wl))
        if row is None:
            continue
        hv = _num(row.get("hit_vs_optimum"))
        what = f"hit rate ≥ {100 * HIT_GOAL:.0f}% of the optimum on {wl}"
        if hv is None:
            lines.append(f"- {what}: not measured")
        else:
            state = "**met**" if hv >= HIT_GOAL else f"**missed** by {100 * (HIT_GOAL - hv):.1f} points"
            lines.append(f"- {what}: {state} ({_fmt(row.get('hit_rate'), '.3f')} of an optimum "
                         f"{_fmt(row.get('optimum_hit_rate'), '.3f')} = {100 * hv:.1f}%)")
    return lines


def _profile_table(p: dict[str, Any]) -> list[str]:
    from runtime.bench.profile import PART_NAMES, PARTS, floor_line, floor_ratio, overhead_line, phase_line

    names = list(p["scenarios"])
    out = [f"In-process step profile (`radixserve bench profile`): {p['model']}, few-shot batch of {p['batch']}, "
           f"context ~{p['context_tokens']} tokens; median ms per step (share of the step).", "",
           "| part | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for part in (*PARTS, "total"):
        cells = []
        for n in names:
            sc = p["scenarios"][n]
            share = f" ({100 * sc[part] / sc['total']:.0f}%)" if part != "total" and sc["total"] else ""
            cells.append(f"{1e3 * sc[part]:.2f}{share}")
        out.append(f"| {PART_NAMES.get(part, part)} | " + " | ".join(cells) + " |")
    out.append("| decodes + new prompt tokens | " + " | ".join(
        f"{int(p['scenarios'][n]['decodes'])} + {int(p['scenarios'][n]['prefill_tokens'])}" for n in names) + " |")
    if "floor" in p:  # profiles saved before the floor probe have none
        out += ["| x weight-streaming floor | " + " | ".join(f"{floor_ratio(p, n):.2f}x" for n in names) + " |",
                "", floor_line(p) + "."]
    for line in (phase_line(p), overhead_line(p)):
        if line:
            out += ["", line[0].upper() + line[1:] + "."]
    ipc = p["ipc"]
    out += ["", f"IPC: a BatchTokenOut of {int(ipc['outputs'])} outputs ({int(ipc['bytes'])} bytes) takes "
            f"{1e6 * ipc['round_trip_s']:.0f} µs for a ZMQ round trip (pickle alone "
            f"{1e6 * ipc['pickle_only_s']:.0f} µs)."]
    return out


def _tier_table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Where a system's hits came from, per memory tier (radixserve with the hierarchical cache only)."""
    rows = [(s, row) for s, row in rows if len(row.get("server_tiers") or {}) > 1]
    if not rows:
        return []
    lines = ["| system | tier | hit tokens | share of hits | loads | mean load | MB in | MB out |",
             "| --- | --- |" + " ---: |" * 6]
    for s, row in rows:
        for name, t in row["server_tiers"].items():
            share = _num(t.get("hit_share"))
            mb = [None if b is None else b / 1e6 for b in (_num(t.get("bytes_written")), _num(t.get("bytes_read")))]
            lines.append(f"| {LABELS.get(s, s)} | {name} | {int(t.get('hit_tokens') or 0)} | "
                         f"{'n/a' if share is None else f'{100 * share:.1f}%'} | {_fmt(t.get('loads'), '.0f')} | "
                         f"{_fmt(t.get('mean_load_ms'), '.2f', ' ms')} | {_fmt(mb[0], '.1f')} | {_fmt(mb[1], '.1f')} |")
    return [*lines, ""]


def _sources(summary: dict[str, Any]) -> str:
    """Where the requests came from: the built-in generators and/or workload files (by name)."""
    names: list[str] = []
    for info in summary.get("workloads", {}).values():
        src = info.get("source")
        text = ("the built-in generators (`runtime/bench/workloads.py`)" if src == SOURCE
                else f"`{portable_text(str(src))}`" if src else "the workload generators")
        if text not in names:
            names.append(text)
    return ", ".join(names) or "the workload generators"


def render_section(summary: dict[str, Any], image_links: list[str]) -> str:
    results = summary["results"]
    systems, workloads, idx = _systems(results), _workloads(results), _index(results)
    m = summary.get("machine", {})
    lines = [BEGIN, "## Peer comparison", "",
             "_Generated by `radixserve bench report` from a saved comparison run; regenerate it, do not edit it._", ""]
    if summary.get("quick"):
        lines += ["> **Quick mode**: reduced workloads (see the sizes below). These figures check that the pipeline "
                  "works; they are not the reference comparison.", ""]
    lines += [f"- Date: {summary.get('date')}; duration {_fmt((summary.get('duration_s') or 0) / 60, '.1f')} min.",
              f"- Machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB, "
              f"{'GPU ' + m['cuda'] if m.get('cuda') else 'no GPU'}; Python {m.get('python')}, torch {m.get('torch')}, "
              f"transformers {m.get('transformers')}; commit {m.get('commit')}.",
              f"- Load average (1/5/15 min) at start {m.get('load_average_start')}, at end {m.get('load_average_end')} "
              "(the machine is shared: wall times are noisier than token counts and hit rates).",
              f"- Command: `{portable_text(summary.get('command') or 'radixserve bench compare')}`", ""]
    lines += ["| system | how it ran |", "| --- | --- |"]
    for s in ORDER:
        info = summary.get("systems", {}).get(s)
        if info is None:
            continue
        how = f"`{portable_text(info['command'])}`" if info.get("command") else ""
        if info.get("status") == "skipped":
            how = f"skipped: {portable_text(str(info.get('reason')))}"
        elif info.get("status") == "failed":
            how += f" — **failed**: {portable_text(str(info.get('reason')).splitlines()[0][:200])}"
        if info.get("n_mode") == "expand":
            how += " (n > 1 sent as n requests)"
        lines.append(f"| {LABELS.get(s, s)} | {how} |")
    lines += ["", f"Every system gets the same requests from {_sources(summary)}, at concurrency "
              f"{summary.get('options', {}).get('concurrency', '?')} (HTTP servers; transformers runs them one by "
              "one), "
              "with one unmeasured warm-up request and a cold cache per workload.", "",
              "| workload | what | sizes |", "| --- | --- | --- |"]
    for wl in workloads:
        info = summary.get("workloads", {}).get(wl, {})
        params = ", ".join(f"{k}={portable_text(str(v))}" for k, v in info.get("params", {}).items())
        lines.append(f"| {wl} | {info.get('description', '')} | {params} |")
    lines += [""] + [f"![{Path(link).stem}]({link})" for link in image_links] + [""]

    lines += ["### Ratios", "", "radixserve's sequences per second divided by each system's, per workload "
              "(goals from the issue in brackets).", "",
              "| workload | " + " | ".join(f"vs {LABELS[s]}" for s in ORDER[1:] if s in systems) + " |",
              "| --- |" + " --- |" * sum(1 for s in ORDER[1:] if s in systems)]
    goals = {(peer, wl): g for peer, wls, g in throughput_goals(summary) for wl in wls}
    for wl in workloads:
        cells = []
        for s in ORDER[1:]:
            if s not in systems:
                continue
            r, g = _ratio(idx, s, wl), goals.get((s, wl))
            cell = "n/a" if r is None else f"{r:.1f}x"
            if g is not None and r is not None:
                cell += f" [≥ {g:g}x: {'met' if r >= g else 'missed'}]"
            cells.append(cell)
        lines.append(f"| {wl} | " + " | ".join(cells) + " |")
    lines += ["", "### Goals", "", *goal_lines(summary), ""]

    lines += ["### Per workload", "", "TTFT: request sent (holding a concurrency slot) to the first streamed "
              "token; e2e: to the last byte. Hit rate: Σ usage.cached_tokens / Σ prompt_tokens; optimum: what a "
              "perfect unbounded cache could reuse on the same requests in the same order.", ""]
    for wl in workloads:
        lines += [f"**{wl}** — {summary.get('workloads', {}).get(wl, {}).get('description', '')}", "",
                  "| system | ok/requests | wall s | req/s | seq/s | out tok/s | TTFT p50 | TTFT p99 | e2e p50 "
                  "| e2e p99 | errors | hit rate | optimum | hit/optimum |",
                  "| --- |" + " ---: |" * 13]
        for s in systems:
            row = idx.get((s, wl))
            if row is None:
                continue
            hv = _num(row.get("hit_vs_optimum"))
            lines.append(
                f"| {LABELS.get(s, s)} | {row['ok']}/{row['requests']} | {_fmt(row['wall_s'], '.1f')} | "
                f"{_fmt(row['requests_per_s'], '.3f')} | {_fmt(row['sequences_per_s'], '.3f')} | "
                f"{_fmt(row['output_tok_per_s'], '.1f')} | {_fmt(row['ttft_p50_s'], '.3f', ' s')} | "
                f"{_fmt(row['ttft_p99_s'], '.3f', ' s')} | {_fmt(row['latency_p50_s'], '.3f', ' s')} | "
                f"{_fmt(row['latency_p99_s'], '.3f', ' s')} | {row['errors']} | {_fmt(row.get('hit_rate'), '.3f')} | "
                f"{_fmt(row.get('optimum_hit_rate'), '.3f')} | {'n/a' if hv is None else f'{100 * hv:.1f}%'} |")
        lines.append("")
        lines += _tier_table([(s, idx[(s, wl)]) for s in systems if (s, wl) in idx])
    if summary.get("profile"):
        lines += ["### Where the time goes", "", *_profile_table(summary["profile"]), ""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def update_page(page: Path, section: str) -> None:
    """Replace the marked section of ``page`` (or append it), leaving everything else untouched."""
    text = page.read_text() if page.is_file() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    page.write_text(text)


def generate(results: Path, docs: Path | None = None, img_dir: Path | None = None) -> Path:
    """Plots + section. Default: ``report.md`` and ``img/`` inside the results folder; with ``docs``,
    the page's marked section is rewritten and the images go to ``img_dir`` (default: beside the page)."""
    results = Path(results)
    summary, records = load_results(results)
    page = Path(docs) if docs is not None else results / "report.md"
    images = Path(img_dir) if img_dir is not None else page.parent / "img"
    paths = make_plots(summary, records, images)
    links = [os.path.relpath(p, page.parent) for p in paths]
    section = render_section(summary, links)
    if docs is None:
        page.write_text("# radixserve benchmark report\n\n" + section)
    else:
        update_page(page, section)
    print(f"report: {page} ({', '.join(str(p) for p in paths)})")
    return page
