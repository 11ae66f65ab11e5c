"""The live cache dashboard of a real server: GET /cache/tree, the stats stream, `radixserve top`, and the page
itself in a real headless Chromium, after a few-shot burst (one shared prefix, several questions under it)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from tests.browser import Chromium, find_chromium
from tests.server_harness import ROOT, ServerProcess, assert_kv_clean

PREFIX = "You are a careful tutor. Answer like the examples.\n" + "".join(
    f"Q: what is {i} plus {i}? A: {2 * i}.\n" for i in range(12))
QUESTIONS = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot"]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """A server of its own: the tree and the hit counters hold this module's burst and nothing else."""
    srv = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "16384", "--num-threads", "1"]).start()
    yield srv
    assert_kv_clean(srv.url)
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def burst(server: ServerProcess, tiny_model_dir: Path) -> list[int]:
    """The few-shot burst, as token ids (so the shared prefix's length is exact); returns the prefix's ids."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prefix = tok(PREFIX).input_ids

    def ask(q: str, stream: bool = False) -> None:
        body = {"input_ids": prefix + tok(f"{q}: what is 7 plus 7?").input_ids,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "stream": stream}
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text

    ask("Zulu")  # caches the prefix
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        list(pool.map(ask, QUESTIONS))
    ask("Yankee", stream=True)  # a streamed request: TTFT and inter-token latencies
    assert_kv_clean(server.url)
    return prefix


def tree(server: ServerProcess, **params: int) -> dict:
    r = httpx.get(server.url + "/cache/tree", params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def shared_node(t: dict) -> dict:
    (top,) = [n for n in t["nodes"] if n["parent"] == 0]
    return top


def test_cache_tree_shows_the_shared_prefix_as_one_node(server, burst, tiny_model_dir):
    t = tree(server)
    top = shared_node(t)
    assert top["tokens"] == len(burst)
    children = [n for n in t["nodes"] if n["parent"] == top["id"]]
    assert len(children) == len(QUESTIONS) + 2, "one branch per question (Zulu and Yankee included)"
    assert top["hits"] >= len(QUESTIONS) + 1 and top["lock_count"] == 0 and top["tier"] == "device"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert top["text"] == tok.decode(burst[:32]) + "…"
    assert any(n["text"].startswith("Bravo: what is 7") for n in children)
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert t["total_tokens"] == info["cache"]["cached_tokens"] == top["subtree_tokens"]
    assert t["total_nodes"] == info["cache"]["num_nodes"]
    assert {"id", "parent", "tokens", "text", "hits", "last_access", "lock_count", "tier"} <= set(top)
    assert t["clock"] >= max(n["last_access"] for n in t["nodes"])


def test_cache_tree_aggregates_and_validates(server, burst):
    small = tree(server, max_nodes=4)
    assert len(small["nodes"]) <= 4
    agg = [n for n in small["nodes"] if n["aggregated"]]
    assert agg and sum(n["tokens"] for n in agg) + sum(n["tokens"] for n in small["nodes"] if n["id"] > 0) \
        == small["total_tokens"]
    folded = tree(server, min_tokens=10_000)
    assert [n["id"] for n in folded["nodes"] if n["id"] > 0] == []
    assert folded["nodes"][1]["aggregated"] == folded["total_nodes"]
    for bad in ("max_nodes=1", "max_nodes=abc", "min_tokens=-1", "max_nodes=99999999"):
        r = httpx.get(f"{server.url}/cache/tree?{bad}", timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == bad.split("=")[0]


def consistent(t: dict) -> None:
    """Each node's subtree tokens are its own plus its children's; the root's are the tree's total."""
    kids: dict[int, int] = {}
    for n in t["nodes"]:
        if n["parent"] is not None:
            kids[n["parent"]] = kids.get(n["parent"], 0) + n["subtree_tokens"]
    for n in t["nodes"]:
        assert n["subtree_tokens"] == n["tokens"] + kids.get(n["id"], 0), n
    assert t["nodes"][0]["subtree_tokens"] == t["total_tokens"]


def read_events(server: ServerProcess, count: int, interval: float = 0.25) -> list[tuple[str, object]]:
    events: list[tuple[str, object]] = []
    with httpx.stream("GET", f"{server.url}/dashboard/stream?interval={interval}", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name or "message", orjson.loads(line[6:])))
                if len(events) >= count:
                    break
    return events


def test_stats_stream_matches_the_server_counters(server, burst):
    events = read_events(server, 4)
    assert events[0][0] == "history" and isinstance(events[0][1], list)
    stats = [e for name, e in events if name == "stats"]
    assert len(stats) == 3
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    for s in stats:
        kv = s["kv"]
        assert kv["free"] + kv["evictable"] + kv["protected"] + kv["private"] == kv["capacity"]
        assert {k: kv[k] for k in ("free", "evictable", "protected", "private", "capacity")} == \
            {k: info["kv"][k] for k in ("free", "evictable", "protected", "private", "capacity")}
        assert s["cache"]["hit_tokens"] == info["cache"]["hit_tokens"]
        assert s["cache"]["hit_rate"] == info["cache"]["hit_rate"] > 0.5
        assert s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0
        assert s["rates"]["prompt_tokens_per_s"] == 0.0, "idle: nothing admitted between samples"
        assert set(s["rates"]) >= {"cached_tokens_per_s", "computed_tokens_per_s", "decode_tokens_per_s"}
    assert stats[-1]["time"] > stats[0]["time"]
    lat = stats[-1]["latency"]
    assert lat["ttft"]["count"] >= 1 and lat["ttft"]["p50"] > 0
    assert lat["itl"]["count"] >= 1 and lat["itl"]["p99"] >= lat["itl"]["p50"]
    # a late viewer gets the samples taken so far
    history = read_events(server, 1)[0][1]
    assert isinstance(history, list) and len(history) >= 3
    assert all(a["time"] < b["time"] for a, b in zip(history, history[1:]))
    r = httpx.get(f"{server.url}/dashboard/stream?interval=0", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "interval"


def test_rates_follow_traffic(server, burst):
    """Prompt, cached and computed tokens per second between two samples reflect the requests admitted."""
    first = httpx.get(server.url + "/dashboard/stats", timeout=30).json()
    body = {"input_ids": burst + [100, 101, 102], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200
    time.sleep(0.6)  # the hub shares a sample younger than half a second
    second = httpx.get(server.url + "/dashboard/stats", timeout=30).json()
    dt = second["time"] - first["time"]
    r = second["rates"]
    assert r["prompt_tokens_per_s"] * dt == pytest.approx(len(burst) + 3, rel=0.05)
    assert r["cached_tokens_per_s"] * dt == pytest.approx(len(burst), rel=0.05)
    assert r["hit_rate"] == pytest.approx(len(burst) / (len(burst) + 3), abs=1e-3)
    assert r["computed_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0


def test_page_and_static_files(server):
    r = httpx.get(server.url + "/dashboard", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "http" not in r.text.replace("http://www.w3.org", ""), "no external assets (offline)"
    for name in ("vendor/uPlot.iife.min.js", "vendor/d3-hierarchy.min.js", "vendor/LICENSE-uPlot",
                 "vendor/LICENSE-d3-hierarchy", "dashboard.js", "common.js"):
        assert httpx.get(f"{server.url}/dashboard/static/{name}", timeout=30).status_code == 200, name
    for bad in ("nope.js", "../dashboard.py", "%2e%2e/dashboard.py"):
        r = httpx.get(f"{server.url}/dashboard/static/{bad}", timeout=30)
        assert r.status_code == 404 and "error" in r.json()


def test_radixserve_top_once(server, burst):
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "top", "--once", "--url", server.url],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert f"hit rate {100 * info['cache']['hit_rate']:.1f}%" in out.stdout
    assert f"{info['kv']['capacity']:,}" in out.stdout and "time to first token" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "runtime.cli", "top", "--once", "--url", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 1 and "ConnectError" in bad.stdout


@pytest.mark.skipif(find_chromium() is None, reason="chromium is not installed (apt-get install chromium); "
                    "the dashboard's browser test needs a real headless browser")
def test_dashboard_in_a_real_browser(server, burst):
    t = tree(server, max_nodes=300)
    top = shared_node(t)
    with Chromium() as browser:
        browser.goto(server.url + "/dashboard")
        shown = browser.wait_for(
            f"(() => {{ const g = document.querySelector('#tree g.node[data-id=\"{top['id']}\"]');"
            " const h = document.getElementById('hit-rate');"
            " return g && h.dataset.hitRate && {tokens: +g.dataset.tokens, label: g.textContent,"
            " parent: g.parentNode.id, hit: +h.dataset.hitRate, hitText: h.textContent,"
            " nodes: document.querySelectorAll('#tree g.node').length}; })()")
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert shown["tokens"] == top["tokens"] == len(burst)
    assert shown["label"].startswith(f"{len(burst)} tok")
    assert shown["nodes"] == len(t["nodes"])
    assert shown["hit"] == info["cache"]["hit_rate"]
    assert shown["hitText"] == f"{100 * info['cache']['hit_rate']:.1f}%"


def test_cache_tree_is_consistent_under_concurrent_traffic(server, burst):
    """Snapshots taken while requests insert, split, lock and unlock nodes are each a consistent tree (last in
    this module: it adds a second branch at the top of the tree)."""
    stop = False
    snapshots: list[dict] = []

    def poll() -> None:
        while not stop:
            snapshots.append(tree(server, max_nodes=50))

    def ask(i: int) -> None:
        body = {"input_ids": list(range(1000, 1040 + 7 * i)) + [300 + i] * 20,
                "sampling_params": {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}}
        assert httpx.post(server.url + "/generate", json=body, timeout=120).status_code == 200

    with ThreadPoolExecutor(5) as pool:
        poller = pool.submit(poll)
        list(pool.map(ask, range(12)))
        stop = True
        poller.result()
    assert len(snapshots) >= 3
    for t in snapshots:
        consistent(t)
    assert any(n["lock_count"] > 0 for t in snapshots for n in t["nodes"]), "a snapshot saw requests running"
    final = tree(server, max_nodes=20_000)
    consistent(final)
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert final["total_tokens"] == info["cache"]["cached_tokens"]
    assert all(n["lock_count"] == 0 for n in final["nodes"])
