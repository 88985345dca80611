"""The /lab page's SLO and overload controls in headless Chromium.

A user picks a preset (the form fills with its options), switches the policy between slo and
fcfs and sees goodput change; fills the queue bound, the request and queue timeouts and sees
refusals and timeouts counted; types a bad target and sees the server's message on the
field. Every number the page shows is checked against `POST /v1/lab/run` on the same server.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from iterserve.lab.options import PRESETS
from iterserve.server.app import create_app

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

# As in test_lab_page.py (Debian's chromium; `make system-deps` installs it).
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 10_000

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing")


def serve_in_thread(app):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("uvicorn did not start")
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}", stop


def lab_run(base_url: str, options: dict) -> dict:
    resp = httpx.post(f"{base_url}/v1/lab/run", json={**options, "per_request": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def shown(page, mode: str, metric: str) -> float:
    node = page.locator(f'[data-mode="{mode}"][data-metric="{metric}"]')
    assert node.is_visible()
    assert node.inner_text().strip() not in ("", "–")
    return float(node.get_attribute("data-value"))


def rerun(page, action) -> None:
    runs = int(page.locator("body").get_attribute("data-runs"))
    action()
    page.wait_for_selector(f'body[data-runs="{runs + 1}"]')


@pytest.fixture(scope="module")
def base_url():
    url, stop = serve_in_thread(create_app(None))
    yield url
    stop()


@pytest.fixture(scope="module")
def page(base_url):
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = b.new_page(viewport={"width": 1280, "height": 800})
        pg.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        pg.on("pageerror", lambda exc: errors.append(str(exc)))
        pg.goto(f"{base_url}/lab")
        pg.wait_for_selector('body[data-runs="1"]')
        pg.wait_for_selector('#opt-preset option[value="slo-overload"]', state="attached")
        yield pg
        pg.close()
        b.close()
        assert not errors, f"JavaScript errors on the page: {errors}"


def test_the_presets_endpoint_lists_what_the_page_offers(page, base_url):
    presets = httpx.get(f"{base_url}/v1/lab/presets", timeout=10).json()
    assert set(presets) == set(PRESETS)
    offered = page.locator("#opt-preset option").evaluate_all("os => os.map(o => o.value)")
    assert offered == [""] + list(PRESETS)


def test_a_preset_fills_the_form_and_goodput_shows_slo_against_fcfs(page, base_url):
    rerun(page, lambda: page.select_option("#opt-preset", "slo-overload"))
    opts = PRESETS["slo-overload"]["options"]
    assert page.input_value("#opt-scheduling_policy") == "slo"
    assert float(page.input_value("#opt-slo_ttft_ms")) == opts["slo_ttft_ms"]
    assert float(page.input_value("#opt-slo_tpot_ms")) == opts["slo_tpot_ms"]
    assert float(page.input_value("#opt-arrival_rate_s")) == opts["arrival_rate_s"]
    assert page.input_value("#opt-max_num_seqs") == str(opts["max_num_seqs"])
    assert page.input_value("#opt-batching") == "continuous"
    assert "fcfs" in page.locator("#preset-description").inner_text()
    slo = lab_run(base_url, {"preset": "slo-overload"})["continuous"]
    assert shown(page, "continuous", "goodput_rps") == pytest.approx(slo["goodput_rps"])
    assert shown(page, "continuous", "refused") == slo["refused"] > 0
    assert shown(page, "continuous", "slo_met") == slo["slo_met"]
    assert "Goodput" in page.locator("#verdict").inner_text()
    # The one knob the preset says to flip: fcfs makes everyone late together.
    rerun(page, lambda: page.select_option("#opt-scheduling_policy", "fcfs"))
    fcfs = lab_run(base_url, {"preset": "slo-overload",
                              "scheduling_policy": "fcfs"})["continuous"]
    assert shown(page, "continuous", "goodput_rps") == pytest.approx(fcfs["goodput_rps"])
    assert shown(page, "continuous", "refused") == 0
    assert slo["goodput_rps"] >= 1.5 * fcfs["goodput_rps"]
    # "Reference case" leaves the preset and its fields.
    rerun(page, lambda: page.click("#reference-case"))
    assert page.input_value("#opt-preset") == ""
    assert page.input_value("#opt-slo_ttft_ms") == ""
    assert page.locator('[data-metric="goodput_rps"]').count() == 0


def test_queue_bound_and_timeouts_reach_the_scheduler(page, base_url):
    def fill():
        page.fill("#opt-arrival_rate", "0.5")
        page.fill("#opt-max_queued_requests", "3")
        page.fill("#opt-request_timeout", "600")
        page.fill("#opt-queue_timeout", "40")
        page.click("#run")

    rerun(page, fill)
    expected = lab_run(base_url, {"arrival_rate": 0.5, "max_queued_requests": 3,
                                  "request_timeout": 600.0, "queue_timeout": 40.0})
    for mode in ("static", "continuous"):
        r = expected[mode]
        assert shown(page, mode, "refused_queue_full") == r["refused_queue_full"]
        assert shown(page, mode, "timed_out") == r["timed_out"]
        assert shown(page, mode, "steps") == r["steps"]
    assert expected["static"]["refused_queue_full"] > 0
    assert expected["static"]["timed_out"] > 0
    plain = lab_run(base_url, {"arrival_rate": 0.5})
    assert plain["static"]["steps"] != expected["static"]["steps"]      # they changed the run
    rerun(page, lambda: page.click("#reference-case"))


def test_a_bad_target_shows_the_servers_message_on_its_field(page):
    page.fill("#opt-slo_ttft_ms", "-5")
    page.click("#run")
    box = page.locator("#error")
    box.wait_for(state="visible")
    assert "slo_ttft_ms" in box.inner_text()
    assert page.get_attribute("#opt-slo_ttft_ms", "aria-invalid") == "true"
    rerun(page, lambda: page.click("#reference-case"))
    assert page.locator("#error").is_hidden()
