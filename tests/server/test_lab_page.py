"""The /lab page in headless Chromium: what a user sees matches what the lab computed.

One browser, one uvicorn server without a model (as `iterserve lab --serve` runs) and one
page serve the tests of this module, which run in order on that page as a user would: load
the reference case, change a knob, replay steps, open a request's trace. The last test puts
a tiny random llama behind the real app and checks the live view against its engine. The numbers the page shows are checked against
`POST /v1/lab/run` on the same server, so the page can only pass by displaying the lab's
own results.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from iterserve.server.app import create_app

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} is missing (Debian's chromium package; `make system-deps` installs it)")

TIMEOUT_MS = 10_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(app):
    """Start uvicorn for `app` on a free port in a daemon thread; return (url, stop)."""
    port = _free_port()
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


@pytest.fixture(scope="module")
def base_url():
    # The app `iterserve lab --serve` runs: no model, the lab page and its endpoint.
    url, stop = serve_in_thread(create_app(None))
    yield url
    stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, base_url):
    pg = browser.new_page(viewport={"width": 1280, "height": 800})
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto(f"{base_url}/lab")
    pg.wait_for_selector('body[data-runs="1"]')
    yield pg
    pg.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def lab_run(base_url: str, options: dict) -> dict:
    resp = httpx.post(f"{base_url}/v1/lab/run", json={**options, "per_request": True}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def shown(page, mode: str, metric: str) -> float:
    """A figure as the page holds it (data-value) after checking it is visible text."""
    node = page.locator(f'[data-mode="{mode}"][data-metric="{metric}"]')
    assert node.is_visible()
    assert node.inner_text().strip() not in ("", "–")
    return float(node.get_attribute("data-value"))


def rerun(page, action) -> None:
    """Do `action` and wait until the page has rendered the run it triggers."""
    runs = int(page.locator("body").get_attribute("data-runs"))
    action()
    page.wait_for_selector(f'body[data-runs="{runs + 1}"]')


# --- the tests, in a user's order ------------------------------------------------------

def test_reference_case_shows_both_modes_as_the_json_endpoint_computes_them(page, base_url):
    expected = lab_run(base_url, {})
    for mode in ("static", "continuous"):
        assert shown(page, mode, "steps") == expected[mode]["steps"]
        assert shown(page, mode, "utilization") == pytest.approx(expected[mode]["utilization"])
        assert shown(page, mode, "mean_latency") == pytest.approx(expected[mode]["mean_latency"])
        assert shown(page, mode, "p99_latency") == pytest.approx(expected[mode]["p99_latency"])
        # The displayed text is the same number, rounded for reading.
        util_text = page.locator(f'[data-mode="{mode}"][data-metric="utilization"]').inner_text()
        assert util_text == f"{100 * expected[mode]['utilization']:.1f}"
    verdict = page.locator("#verdict").inner_text()
    assert f"{expected['continuous']['steps']:,} steps instead of {expected['static']['steps']:,}" \
        in verdict
    # The legend lists only what the charts show: no prefill, preemption or priority here.
    assert page.locator('#legend [data-legend="prefill"]').is_hidden()
    assert page.locator('#legend [data-legend="preempt"]').is_hidden()
    # One occupancy chart per mode, a bar per (request, segment).
    for mode in ("static", "continuous"):
        segments = sum(len(r["segments"]) for r in expected[mode]["per_request"])
        assert page.locator(f'#charts svg[data-mode="{mode}"] rect.seg').count() == segments


def test_changing_a_knob_reruns_and_updates_the_figures_in_place(page, base_url):
    before = shown(page, "static", "steps")
    rerun(page, lambda: (page.fill("#opt-max_num_seqs", "4"),
                         page.press("#opt-max_num_seqs", "Enter")))
    expected = lab_run(base_url, {"max_num_seqs": 4})
    for mode in ("static", "continuous"):
        assert shown(page, mode, "steps") == expected[mode]["steps"]
        assert shown(page, mode, "utilization") == pytest.approx(expected[mode]["utilization"])
        assert page.locator(f'#charts svg[data-mode="{mode}"] rect.row').count() == 4
    assert shown(page, "static", "steps") != before
    # Another seed draws another workload.
    rerun(page, lambda: (page.fill("#opt-seed", "7"), page.press("#opt-seed", "Enter")))
    expected = lab_run(base_url, {"max_num_seqs": 4, "seed": 7})
    assert shown(page, "continuous", "steps") == expected["continuous"]["steps"]
    # "Reference case" puts every knob back.
    rerun(page, lambda: page.click("#reference-case"))
    assert page.input_value("#opt-max_num_seqs") == "8"
    assert shown(page, "static", "steps") == before


def test_step_slider_replays_who_is_running_waiting_and_finished(page, base_url):
    expected = lab_run(base_url, {})
    for mode_step in (0, 400, 1500):
        page.locator("#step-slider").fill(str(mode_step))
        assert page.locator("#step-value").inner_text() == f"{mode_step:,}"
        for mode in ("static", "continuous"):
            res = expected[mode]
            s = min(mode_step, res["steps"] - 1)
            for key in ("running", "waiting", "finished"):
                node = page.locator(f'[data-mode="{mode}"][data-step-metric="{key}"]')
                assert int(node.get_attribute("data-value")) == res["timeline"][key][s], (mode, key)
            running_ids = {r["id"] for r in res["per_request"]
                           if any(g["start"] <= s < g["end"] for g in r["segments"])}
            chips = page.locator(f'#step-view [data-mode="{mode}"] .chip')
            assert {chips.nth(i).get_attribute("data-request-id")
                    for i in range(chips.count())} == running_ids
    # The queue-over-the-run charts follow the slider with their cursor.
    page.locator("#step-slider").fill("0")
    cursor = page.locator('#timelines svg[data-mode="continuous"] .cursor')
    at_start = float(cursor.get_attribute("x1"))
    page.locator("#step-slider").fill("800")
    assert float(cursor.get_attribute("x1")) > at_start
    # Play replays from where the slider is, and Pause stops it.
    page.locator("#step-slider").fill("0")
    page.click("#play")
    assert page.get_attribute("#play", "aria-pressed") == "true"
    page.wait_for_function("() => Number(document.querySelector('#step-slider').value) > 50")
    page.click("#play")
    assert page.get_attribute("#play", "aria-pressed") == "false"
    stopped_at = page.input_value("#step-slider")
    page.wait_for_timeout(150)
    assert page.input_value("#step-slider") == stopped_at


def test_clicking_a_bar_opens_that_requests_trace(page, base_url):
    expected = {r["id"]: r for r in lab_run(base_url, {})["continuous"]["per_request"]}
    bar = page.locator('#charts svg[data-mode="continuous"] rect.seg').nth(3)
    request_id = bar.get_attribute("data-request-id")
    bar.click()
    trace = page.locator(f'#trace[data-request-id="{request_id}"][data-mode="continuous"]')
    trace.wait_for()
    req = expected[request_id]
    assert [li.get_attribute("data-event") for li in trace.locator("li").all()] == \
        [e["event"] for e in req["events"]]
    for fact in ("arrival", "first_scheduled", "finish", "latency"):
        assert float(trace.locator(f'[data-trace-fact="{fact}"]').get_attribute("data-value")) \
            == req[fact]
    # The chart highlights the request's bars.
    assert page.locator(f'#charts rect.seg.selected[data-request-id="{request_id}"]').count() \
        == len(req["segments"])


def test_a_trace_can_be_opened_with_the_keyboard(page, base_url):
    static_ids = [r["id"] for r in lab_run(base_url, {})["static"]["per_request"]]
    page.focus("#trace-mode")
    page.select_option("#trace-mode", "static")
    page.select_option("#trace-request", static_ids[5])
    page.focus("#show-trace")
    page.keyboard.press("Enter")
    page.locator(f'#trace[data-request-id="{static_ids[5]}"][data-mode="static"]').wait_for()


def test_prefill_knobs_show_ttft_kv_blocks_and_preemptions(page, base_url):
    options = {"prompt_len": [50, 400], "num_kv_blocks": 100, "arrival_rate": 0.5}

    def set_prefill():
        page.fill("#opt-prompt-min", "50")
        page.fill("#opt-prompt-max", "400")
        page.fill("#opt-num_kv_blocks", "100")
        page.fill("#opt-arrival_rate", "0.5")
        page.click("#run")

    rerun(page, set_prefill)
    expected = lab_run(base_url, options)
    for mode in ("static", "continuous"):
        assert shown(page, mode, "mean_ttft") == pytest.approx(expected[mode]["mean_ttft"])
        assert shown(page, mode, "preemptions") == expected[mode]["preemptions"]
    assert page.locator('#legend [data-legend="prefill"]').is_visible()
    assert page.locator('#legend [data-legend="preempt"]').is_visible()
    marks = page.locator('#charts svg[data-mode="continuous"] .preempt-mark').count()
    assert marks == sum(r["preemptions"] for r in expected["continuous"]["per_request"])
    page.locator("#step-slider").fill("100")
    kv = page.locator('[data-mode="continuous"][data-step-metric="kv_blocks_used"]')
    assert int(kv.get_attribute("data-value")) == expected["continuous"]["timeline"]["kv_blocks_used"][100]
    assert "/ 100" in kv.inner_text()


def test_a_bad_knob_shows_the_servers_message_and_marks_the_field(page):
    page.fill("#opt-short-min", "200")   # min above max (100)
    page.click("#run")
    box = page.locator("#error")
    box.wait_for(state="visible")
    assert "short" in box.inner_text()
    assert page.get_attribute("#opt-short-min", "aria-invalid") == "true"
    rerun(page, lambda: page.click("#reference-case"))
    assert page.locator("#error").is_hidden()
    assert page.get_attribute("#opt-short-min", "aria-invalid") is None


def test_scheduler_knobs_and_the_longprompt_mix_reach_the_lab(page, base_url):
    options = {"mix": "longprompt", "long_prefill_token_threshold": 256,
               "max_num_partial_prefills": 2, "enable_prefix_caching": True}

    def set_knobs():
        page.select_option("#opt-mix", "longprompt")
        page.fill("#opt-long_prefill_token_threshold", "256")
        page.fill("#opt-max_num_partial_prefills", "2")
        page.check("#opt-enable_prefix_caching")
        page.click("#run")

    rerun(page, set_knobs)
    expected = lab_run(base_url, options)
    assert expected != lab_run(base_url, {"mix": "longprompt"})   # the knobs change the run
    for mode in ("static", "continuous"):
        assert shown(page, mode, "mean_ttft") == pytest.approx(expected[mode]["mean_ttft"])
        assert shown(page, mode, "steps") == expected[mode]["steps"]
    rerun(page, lambda: page.click("#reference-case"))
    assert page.input_value("#opt-mix") == "reference"
    assert not page.is_checked("#opt-enable_prefix_caching")


def test_live_panel_is_hidden_without_a_model_and_shows_engine_stats_when_there_is_one(page):
    assert page.locator("#live").is_hidden()   # no engine here: /v1/engine/stats is a 503
    stats = {
        "model": "tiny-llama", "step": 120, "num_running": 3, "num_waiting": 5,
        "num_swapped": 1, "kv_cache_usage": 0.25, "num_free_blocks": 768, "num_blocks": 1024,
        "num_preemptions_total": 2,
        "history": [{"step": i, "time": 0.01 * i, "num_batched_tokens": 40 + i % 7,
                     "num_running": 3, "num_waiting": 5 - i % 2, "num_swapped": 0,
                     "kv_cache_usage": 0.2} for i in range(60)],
        "recent_requests": [{
            "request_id": "cmpl-abc", "status": "finished", "finish_reason": "length",
            "prompt_tokens": 12, "output_tokens": 16, "num_preemptions": 0,
            "events": [{"event": "arrived", "time": 1.0, "step": 100},
                       {"event": "first_token", "time": 1.02, "step": 101},
                       {"event": "finished", "time": 1.2, "step": 116}]}],
    }
    page.route("**/v1/engine/stats", lambda route: route.fulfill(json=stats))
    try:
        page.reload()
        page.wait_for_selector('body[data-runs="1"]')
        page.locator("#live").wait_for(state="visible")
        assert page.locator('[data-live="num_running"]').inner_text() == "3"
        assert page.locator('[data-live="num_waiting"]').inner_text() == "5"
        assert page.locator('[data-live="num_swapped"]').inner_text() == "1"
        assert "256 / 1,024 blocks" in page.locator('[data-live="kv_cache_usage"]').inner_text()
        assert page.locator("#live-charts svg rect.bar").count() == 60
        summary = page.locator('#live-requests details[data-request-id="cmpl-abc"] summary')
        summary.focus()
        page.keyboard.press("Enter")
        events = page.locator('#live-requests details[data-request-id="cmpl-abc"] li')
        assert [e.get_attribute("data-event") for e in events.all()] == \
            ["arrived", "first_token", "finished"]
    finally:
        page.unroute("**/v1/engine/stats")


def test_screenshots_at_1280x800_and_on_a_narrow_window_fit_the_width(page, tmp_path):
    page.set_viewport_size({"width": 1280, "height": 800})
    page.evaluate("window.scrollTo(0, 0)")
    wide = tmp_path / "lab-1280x800.png"
    page.screenshot(path=str(wide))
    page.set_viewport_size({"width": 400, "height": 800})
    # The charts redraw for the new width after a debounce (replacing their SVGs), so wait
    # for the redrawn chart rather than a fixed time. Readable on a narrow window: nothing,
    # charts included, sticks out sideways (a TimeoutError here means it does).
    page.wait_for_function(
        """() => {
            const svg = document.querySelector('#charts svg[data-mode="static"]');
            return svg && svg.getBoundingClientRect().width <= 400
                && document.documentElement.scrollWidth <= 400;
        }""", timeout=10_000)
    narrow = tmp_path / "lab-narrow.png"
    page.screenshot(path=str(narrow), full_page=True)
    assert wide.stat().st_size > 10_000 and narrow.stat().st_size > 10_000



# --- the live view against a real engine ----------------------------------------------

def test_live_view_shows_the_real_engines_counters_and_request_traces(browser, tiny_model_dir):
    """A tiny random llama behind the real app: the panel appears, and once requests have
    flowed through the engine it shows the engine's own counters and each request's trace."""
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), num_kv_blocks=64))
    url, stop = serve_in_thread(create_app(engine, served_model_name="tiny-llama"))
    pg = browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        answers: list[httpx.Response] = []

        def send(i: int) -> None:
            answers.append(httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": f"hello {i}", "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}))

        pg.set_default_timeout(TIMEOUT_MS)
        pg.goto(f"{url}/lab")
        pg.locator("#live").wait_for(state="visible")
        assert "tiny-llama" in pg.locator("#live-model").inner_text()
        senders = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(timeout=60)
        assert [a.status_code for a in answers] == [200] * 4
        stats = httpx.get(f"{url}/v1/engine/stats", timeout=10).json()
        assert stats["step"] > 0
        # The page catches up within a poll or two and shows the same numbers.
        pg.wait_for_function(
            "s => document.querySelector('[data-live=\"step\"]')?.dataset.value === String(s)",
            arg=stats["step"])
        assert pg.locator('[data-live="num_running"]').get_attribute("data-value") == "0"
        assert pg.locator("#live-charts svg rect.bar").count() == len(stats["history"])
        ids = [r["request_id"] for r in stats["recent_requests"]]
        assert len(ids) == 4
        details = pg.locator(f'#live-requests details[data-request-id="{ids[0]}"]')
        details.locator("summary").click()
        events = [li.get_attribute("data-event") for li in details.locator("li").all()]
        assert events == [e["event"] for e in stats["recent_requests"][0]["events"]]
        assert events[-1] == "finished"
    finally:
        pg.close()
        stop()
