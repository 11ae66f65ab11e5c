"""``radixserve top --url URL``: the dashboard's figures in a terminal (rich), for hosts without a browser.

It polls ``GET /dashboard/stats`` (a server's live sample, or a router's per-worker view) and redraws
once per ``--interval``; ``--once`` prints one frame and exits (scripts, tests).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text


def add_top_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "top", help="Live cache, KV and traffic figures of a server or router in the terminal.",
        description="The figures of GET /dashboard in a terminal: KV pool, cache hit rate, token rates, "
        "requests, latency percentiles (or, against a router, one row per worker).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="Base URL of the server or router.")
    parser.add_argument("--interval", type=float, default=1.0, help="Seconds between refreshes.")
    parser.add_argument("--once", action="store_true", help="Print one frame and exit.")
    parser.add_argument("--api-key", default=None, help="Bearer key, for a server started with --api-key.")
    return parser


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    return "–" if x is None else (f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}")


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1000 * x:.1f} ms"


def server_frame(s: dict[str, Any], url: str) -> RenderableType:
    kv, c, r, lat = s["kv"], s["cache"], s["rates"], s["latency"]
    head = Text.assemble(("radixserve top ", "bold"), (f"{url} · {s.get('model', '')}", "dim"))
    summary = Table.grid(padding=(0, 3))
    summary.add_row(f"hit rate {_pct(c['hit_rate'])}", f"last interval {_pct(r['hit_rate'])}",
                    f"running {s['num_running_reqs']}", f"waiting {s['num_waiting_reqs']}",
                    f"nodes {c['num_nodes']:,}")
    pool = Table(title="KV pool (tokens)", title_justify="left")
    for col in ("free", "evictable", "protected", "held by running", "capacity"):
        pool.add_column(col, justify="right")
    pool.add_row(*(f"{kv[k]:,}" for k in ("free", "evictable", "protected", "private", "capacity")))
    rates = Table(title="tokens / s", title_justify="left")
    for col in ("prompt", "cached", "computed", "decode"):
        rates.add_column(col, justify="right")
    rates.add_row(*(_num(r[f"{k}_tokens_per_s"]) for k in ("prompt", "cached", "computed", "decode")))
    latency = Table(title="latency (streamed requests)", title_justify="left")
    for col in ("", "p50", "p90", "p99", "count"):
        latency.add_column(col, justify="right")
    for key, name in (("ttft", "time to first token"), ("itl", "inter-token")):
        lv = lat[key]
        latency.add_row(name, _ms(lv["p50"]), _ms(lv["p90"]), _ms(lv["p99"]), f"{lv['count']:.0f}")
    return Group(head, summary, pool, rates, latency)


def router_frame(s: dict[str, Any], url: str) -> RenderableType:
    head = Text.assemble(("radixserve top ", "bold"), (f"{url} · router, policy {s['policy']}, "
                                                       f"{s['queued']} queued", "dim"))
    table = Table(title="workers", title_justify="left")
    for col in ("worker", "healthy", "in flight", "routed", "predicted hit", "reported hit", "running",
                "waiting", "KV used", "decode tok/s"):
        table.add_column(col, justify="right")
    for w in s["workers"]:
        ws = w.get("stats") or {}
        kv = ws.get("kv")
        table.add_row(w["url"], "yes" if w["healthy"] else "[red]no[/red]", str(w["load"]), str(w["routed"]),
                      _pct(w["estimated_hit_rate"]), _pct(w["actual_hit_rate"]),
                      str(ws.get("num_running_reqs", "–")), str(ws.get("num_waiting_reqs", "–")),
                      _pct(1 - kv["free"] / kv["capacity"]) if kv else "–",
                      _num(ws["rates"]["decode_tokens_per_s"]) if ws else "–")
    return Group(head, table)


def frame(client: httpx.Client, url: str) -> RenderableType:
    try:
        resp = client.get(url + "/dashboard/stats")
    except httpx.HTTPError as exc:
        return Text(f"{url}: {type(exc).__name__}: {exc}", style="red")
    if resp.status_code != 200:
        return Text(f"{url}/dashboard/stats: HTTP {resp.status_code}: {resp.text[:300]}", style="red")
    s = resp.json()
    return router_frame(s, url) if s.get("router") else server_frame(s, url)


def run_top(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    console = Console()
    with httpx.Client(timeout=10, headers=headers) as client:
        if args.once:
            out = frame(client, url)
            console.print(out)
            return 1 if isinstance(out, Text) else 0
        with Live(frame(client, url), console=console, auto_refresh=False, screen=False) as live:
            try:
                while True:
                    time.sleep(max(0.1, args.interval))
                    live.update(frame(client, url), refresh=True)
            except KeyboardInterrupt:
                return 0
