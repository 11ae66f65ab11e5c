"""The router's dashboard: per-worker panels (load, routed requests, predicted vs reported hit rate, the worker's
own live figures), its JSON, `radixserve top` against a router, and the page in a real headless Chromium."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.browser import Chromium, find_chromium
from tests.router.conftest import RouterProcess, start_workers
from tests.server_harness import ROOT, ServerProcess, assert_kv_clean

PREFIX = "System: answer briefly.\n" + "".join(f"Example {i}: {i} times two is {2 * i}.\n" for i in range(10))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[tuple[RouterProcess, list[ServerProcess]]]:
    workers = start_workers(str(tiny_model_dir), 2, kv_events=False)
    router = RouterProcess([w.url for w in workers], ["--policy", "cache_aware"])
    try:
        router.start()
        body = {"sampling_params": {"max_new_tokens": 4, "temperature": 0}}

        def ask(i: int) -> None:
            r = httpx.post(router.url + "/generate", json={**body, "text": PREFIX + f"Question {i}: 7 times two?"},
                           timeout=120)
            assert r.status_code == 200, r.text

        ask(-1)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(ask, range(8)))
        yield router, workers
        for w in workers:
            assert_kv_clean(w.url)
    finally:
        router.stop()
        for w in workers:
            w.stop()


def test_router_dashboard_stats(cluster):
    router, workers = cluster
    stats = httpx.get(router.url + "/dashboard/stats", timeout=30).json()
    assert stats["router"] is True and stats["policy"] == "cache_aware"
    listed = {w["url"]: w for w in router.workers().values()}
    assert [w["url"] for w in stats["workers"]] == [w.url for w in workers]
    assert sum(w["routed"] for w in stats["workers"]) == 9
    for w in stats["workers"]:
        ref = listed[w["url"]]
        assert (w["routed"], w["estimated_hit_rate"], w["actual_hit_rate"]) == \
            (ref["routed"], ref["estimated_hit_rate"], ref["actual_hit_rate"])
        own = httpx.get(w["url"] + "/get_server_info", timeout=30).json()
        assert w["stats"]["kv"]["capacity"] == own["kv"]["capacity"]
        assert w["stats"]["cache"]["hit_tokens"] == own["cache"]["hit_tokens"]
    assert any(w["actual_hit_rate"] > 0.5 for w in stats["workers"]), "the shared prefix was reused"
    r = httpx.get(router.url + "/dashboard/stream?interval=x", timeout=30)
    assert r.status_code == 400 and "interval" in r.json()["error"]["message"]
    with httpx.stream("GET", router.url + "/dashboard/stream?interval=0.25", timeout=30) as r:
        lines = [line for _, line in zip(range(2), (x for x in r.iter_lines() if x.startswith("data: ")))]
    assert len(lines) == 2 and '"workers"' in lines[0]


def test_top_against_the_router(cluster):
    router, workers = cluster
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "top", "--once", "--url", router.url],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env={"COLUMNS": "250",
                                                                                     "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "policy cache_aware" in out.stdout
    for w in workers:
        assert w.url in out.stdout


@pytest.mark.skipif(find_chromium() is None, reason="chromium is not installed (apt-get install chromium); "
                    "the router dashboard's browser test needs a real headless browser")
def test_router_dashboard_in_a_real_browser(cluster):
    router, workers = cluster
    listed = router.workers()
    with Chromium() as browser:
        browser.goto(router.url + "/dashboard")
        shown = browser.wait_for(
            "(() => { const ps = [...document.querySelectorAll('.panel.worker')];"
            " return ps.length && ps.every(p => p.querySelector('.field-kv').textContent.endsWith('%')) &&"
            " ps.map(p => ({url: p.dataset.url, routed: +p.querySelector('.field-routed').textContent,"
            " reported: p.querySelector('.field-reported').textContent,"
            " health: p.querySelector('.health').textContent})); })()")
    assert [p["url"] for p in shown] == [w.url for w in workers]
    for p in shown:
        ref = listed[p["url"]]
        assert p["routed"] == ref["routed"] and p["health"] == "healthy"
        assert p["reported"] == f"{100 * ref['actual_hit_rate']:.1f}%"
