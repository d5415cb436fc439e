"""The /dashboard page in a real browser (Debian's chromium, driven by Playwright).

One server (a tiny random-weight Llama on the command line, a python model
from a repository, a route, a price and an API key) for the module; a fresh
browser context (so a fresh sessionStorage) per test. With
KILN_UPDATE_SCREENSHOTS=1 the playground test writes docs/dashboard.png, the
README's screenshot.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.integration.openai.live import ROOT, kiln_server
from tests.unit.serving.models import DOUBLER_PY, doubler_config, write_model

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY = "dashboard-secret"
SCREENSHOT = ROOT / "docs" / "dashboard.png"

if not Path(CHROMIUM).is_file():
    pytest.skip("Debian's chromium is not installed (`make install-test` installs it with apt-get; "
                "it could not here): skipping the dashboard browser tests", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("dashboard")
    repo = tmp / "repo"
    write_model(repo, "doubler", doubler_config(dynamic_batching={"max_queue_delay_ms": 2}),
                {1: {"model.py": DOUBLER_PY}})
    routes = tmp / "routes.yaml"
    routes.write_text("routes:\n  assistant:\n    targets: {tiny: 3, doubler: 1}\n")
    args = ("--served-model-name", "tiny", "--num-blocks", "64", "--max-model-len", "256",
            "--model-repository", str(repo), "--grpc-port", "-1", "--routes-file", str(routes),
            "--price-per-hour", "2.5", "--cost-window-s", "10", "--model-control", "explicit")
    with kiln_server(tiny_llama_dir, *args, tmp_dir=tmp, api_key=KEY) as live:
        yield live


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield instance
        instance.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.errors = []  # console errors and uncaught exceptions of this page
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    yield page
    context.close()


def login(page, server, key=KEY, query=""):
    page.goto(server.base_url + "/dashboard" + query)
    page.wait_for_selector("#login-form", state="visible")
    page.fill("#api-key", key)
    page.click("#login-form button[type=submit]")


def send_traffic(server):
    for _ in range(3):
        r = server.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 8})
        assert r.status_code == 200, r.text
        body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": np.arange(4.0).tolist()}]}
        r = server.post("/v2/models/doubler/infer", json=body)
        assert r.status_code == 200, r.text


def test_unauthenticated_access_is_refused(server, page):
    assert httpx.get(server.base_url + "/dashboard/api/stats").status_code == 401
    assert httpx.post(server.base_url + "/v2/repository/models/doubler/unload").status_code == 401
    shell = httpx.get(server.base_url + "/dashboard")
    assert shell.status_code == 200 and "Kiln dashboard" in shell.text and "doubler" not in shell.text
    login(page, server, key="wrong")
    page.wait_for_selector("text=That API key was refused.")
    assert page.is_hidden("#main") and page.is_visible("#login-form")
    assert page.locator("#models tbody tr").count() == 0  # nothing about the server reached the page


def test_dashboard_loads_without_console_errors_and_charts_update(server, page):
    login(page, server)
    page.wait_for_selector("#main", state="visible")
    page.wait_for_selector("#models tbody tr[data-model=doubler] .pill.ready")
    assert page.locator("#models tbody tr").count() == 2
    assert page.input_value("#subject") == "model:tiny"
    send_traffic(server)
    # the charts' own data (what uPlot draws) shows the requests within a few polls
    page.wait_for_function("() => (window.kilnDashboard.charts['Requests/s']?.data[1] || []).some(v => v > 0)",
                           timeout=20_000)
    page.wait_for_function("() => (window.kilnDashboard.charts['TTFT / TPOT (ms)']?.data[2] || [])"
                           ".some(v => v > 0)", timeout=20_000)
    assert page.locator("#charts .chart canvas").count() == 8
    page.select_option("#subject", "model:doubler")
    page.wait_for_function("() => (window.kilnDashboard.charts['Latency (ms)']?.data[3] || []).some(v => v > 0)",
                           timeout=20_000)
    page.select_option("#subject", "route:assistant:tiny")
    page.wait_for_selector("#charts .chart[data-title='Share of the route (%)']")
    assert page.locator("#routes tr[data-route=assistant]").count() == 2
    assert "75.0%" in page.inner_text("#routes")
    assert page.errors == []


def test_a_poll_interval_below_the_floor_does_not_flood_the_server(server, page):
    polls = []
    page.on("request", lambda r: polls.append(r.url) if "/dashboard/api/stats" in r.url else None)
    login(page, server, query="?interval_ms=-1")
    page.wait_for_selector("#main", state="visible")
    polls.clear()
    page.wait_for_timeout(2000)
    assert 2 <= len(polls) <= 10  # every 250 ms at most (a value below 1 polled ~70 times a second)
    assert page.errors == []


def test_model_control_buttons(server, page):
    login(page, server)
    row = "#models tbody tr[data-model=doubler]"
    page.wait_for_selector(f"{row} .pill.ready")
    page.click(f"{row} button[data-action=unload]")
    page.wait_for_selector(f"{row} .pill.unloaded")
    assert server.post("/v2/models/doubler/infer", json={"inputs": []}).status_code == 503
    page.click(f"{row} button[data-action=load]")
    page.wait_for_selector(f"{row} .pill.ready")
    assert "doubler: loaded" in page.inner_text("#control-message")
    assert page.errors == []


def test_playground_streams_an_answer(server, page):
    login(page, server)
    page.wait_for_selector("#main", state="visible")
    send_traffic(server)
    page.wait_for_function("() => (window.kilnDashboard.charts['Requests/s']?.data[1] || []).some(v => v > 0)",
                           timeout=20_000)
    assert page.input_value("#chat-model") == "tiny"
    page.fill("#chat-max-tokens", "24")
    page.fill("#chat-input", "Tell me about kilns.")
    page.click("#chat-send")
    page.wait_for_selector("#chat-status[data-state=done]", timeout=60_000)
    answer = page.locator(".message.assistant").last
    assert int(answer.get_attribute("data-chunks")) > 1  # rendered delta by delta
    assert answer.inner_text().strip()
    assert "done: " in page.inner_text("#chat-status") and "24 tokens" in page.inner_text("#chat-status")
    assert page.errors == []
    if os.environ.get("KILN_UPDATE_SCREENSHOTS") == "1":
        for _ in range(8):  # a few seconds of history, so the charts draw lines
            send_traffic(server)
            page.wait_for_timeout(700)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
