"""The lab page on a server with --api-key: the page itself loads without the key,
asks for it once, and its calls (/v1/lab/run, /v1/engine/stats) then carry it."""

from __future__ import annotations

import os

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing")


def test_the_lab_page_asks_for_the_key_once_and_sends_it(start_server):
    s = start_server(api_key="sekret")
    prompts: list[str] = []
    auth_headers: list[str | None] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.set_default_timeout(15_000)

        def on_dialog(dialog):
            prompts.append(dialog.message)
            dialog.accept("sekret")

        page.on("dialog", on_dialog)
        page.on("request", lambda r: auth_headers.append(r.headers.get("authorization"))
                if "/v1/" in r.url else None)
        page.goto(f"{s.base_url}/lab")
        page.wait_for_selector('body[data-runs="1"]')          # the lab ran with the key
        # the live view polls /v1/engine/stats with the key too
        page.wait_for_function("() => !document.querySelector('#live').hidden")
        browser.close()
    assert len(prompts) == 1, prompts
    assert "Bearer sekret" in auth_headers
