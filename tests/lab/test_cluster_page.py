"""The lab page's cluster view in headless Chromium, and POST /v1/lab/cluster behind it.

The page is the `iterserve lab --serve` app (no model). What it shows is checked against
the endpoint's JSON for the same options, so it can only pass by displaying the cluster
lab's own results; the endpoint is checked against `run_cluster_lab`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from iterserve.lab.cluster import run_cluster_lab
from iterserve.server.app import create_app

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 30_000

# The page's defaults (lab_cluster.js FIELDS), as options.
PAGE_DEFAULTS = {"data_parallel_size": 4, "router": "prefix_aware", "max_num_seqs": 8,
                 "requests": 400, "arrival_rate_s": 3.0, "prompt_len": [8, 40],
                 "prefix_groups": 64, "prefix_len": 256, "enable_prefix_caching": True,
                 "cost_model": "smollm2-cpu", "batching": "continuous"}


# --- the endpoint, without a browser -----------------------------------------------------
@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(None)) as c:
        yield c


def test_endpoint_returns_run_cluster_lab(client):
    opts = {"data_parallel_size": 2, "router": "least_loaded", "requests": 40,
            "prompt_len": [8, 40], "arrival_rate_s": 3.0, "cost_model": "smollm2-cpu"}
    resp = client.post("/v1/lab/cluster", json=opts)
    assert resp.status_code == 200, resp.text
    assert resp.json() == json.loads(json.dumps(run_cluster_lab(opts)))


@pytest.mark.parametrize("body, param, says", [
    ({"router": "random"}, "router", "must be one of"),
    ({"data_parallel_size": 0}, "data_parallel_size", "at least 1"),
    ({"cost_model": "/etc/passwd"}, "cost_model", "no shipped cost model"),
    ({"requests": 100_000}, "requests", "at most"),
    ({"requests": 1000, "search": "rate", "search_p99_ttft_ms": 500.0}, "requests",
     "over its search"),
])
def test_endpoint_bad_options_are_400_naming_the_option(client, body, param, says):
    resp = client.post("/v1/lab/cluster", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and says in err["message"]
    assert err["type"] == "invalid_request_error"


def test_endpoint_rejects_non_objects(client):
    assert client.post("/v1/lab/cluster", content=b"[1]").status_code == 400
    assert client.post("/v1/lab/cluster", content=b"{nope").status_code == 400
    assert client.get("/lab/static/lab_cluster.js").status_code == 200


# --- the page ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url():
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(None), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("uvicorn did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def page(base_url):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (`make system-deps` installs it)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1280, "height": 900})
        pg.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        pg.on("pageerror", lambda exc: errors.append(str(exc)))
        pg.goto(f"{base_url}/lab")
        pg.wait_for_selector('body[data-runs="1"]')      # the single view ran as before
        yield pg
        browser.close()
        assert not errors, f"JavaScript errors on the page: {errors}"


def _click_and_wait(page, selector: str) -> None:
    runs = int(page.locator("#cluster").get_attribute("data-cluster-runs") or 0)
    page.click(selector)
    page.wait_for_selector(f'#cluster[data-cluster-runs="{runs + 1}"]')


def _cluster(base_url: str, options: dict) -> dict:
    resp = httpx.post(f"{base_url}/v1/lab/cluster", json=options, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_page_runs_the_cluster_and_shows_what_the_endpoint_computes(page, base_url):
    page.fill("#cl-requests", "200")
    _click_and_wait(page, "#cluster-run")
    want = _cluster(base_url, {**PAGE_DEFAULTS, "requests": 200})
    for metric in ("throughput_tokens_per_s", "p99_ttft_s", "prefix_cache_hit_rate",
                   "load_imbalance"):
        node = page.locator(f'#cluster-figures [data-cluster-metric="{metric}"]')
        assert node.is_visible()
        assert float(node.get_attribute("data-value")) == pytest.approx(want[metric])
    rows = page.locator("#cluster-replicas tbody tr")
    assert rows.count() == 4
    for p in want["per_replica"]:
        row = page.locator(f'#cluster-replicas tr[data-replica="{p["replica"]}"]')
        assert int(row.locator('[data-col="requests"]').get_attribute("data-value")) == \
            p["requests"]
        assert float(row.locator('[data-col="slot_utilization"]').get_attribute(
            "data-value")) == pytest.approx(p["slot_utilization"])


def test_compare_routers_shows_prefix_aware_ahead_on_shared_prefixes(page, base_url):
    _click_and_wait(page, "#cluster-compare-btn")
    rates = {}
    for router in ("round_robin", "least_loaded", "prefix_aware"):
        cell = page.locator(f'#cluster-compare tr[data-router="{router}"] '
                            '[data-col="prefix_cache_hit_rate"]')
        rates[router] = float(cell.get_attribute("data-value"))
    want = _cluster(base_url, {**PAGE_DEFAULTS, "requests": 200, "router": "round_robin"})
    assert rates["round_robin"] == pytest.approx(want["prefix_cache_hit_rate"])
    assert rates["prefix_aware"] >= 2 * rates["round_robin"]


def test_a_bad_value_shows_the_servers_message_and_marks_the_field(page):
    page.fill("#cl-data_parallel_size", "0")
    _click_and_wait(page, "#cluster-run")
    assert "data_parallel_size: must be at least 1" in page.inner_text("#cluster-error")
    assert page.get_attribute("#cl-data_parallel_size", "aria-invalid") == "true"
    page.fill("#cl-data_parallel_size", "2")
    page.fill("#cl-requests", "60")
    page.select_option("#cl-search", "rate")
    page.fill("#cl-search_p99_ttft_ms", "2000")
    _click_and_wait(page, "#cluster-run")
    assert page.locator("#cluster-error").is_hidden()
    text = page.inner_text("#cluster-search")
    assert "Highest rate with p99 TTFT ≤ 2000 ms on 2 replicas" in text
