"""The dashboard in a real browser: ``panel serve apps/dashboard.py`` + Playwright + Chromium.

Loads the page, changes knobs (affinity token compression in the VisMMOE card among them),
presses Run and waits until the plots show the new run (data read from the plotly elements,
searched through Panel's shadow roots), checks the run used the knobs and that the kept/pruned
visual-token overlay is drawn, that a view filter and the replay view's policy selection redraw
without a new run, that there were no console errors, and saves ``test-artifacts/dashboard.png``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

#: every plotly element of the page, through shadow roots: [{view, run, data, title}]
PLOTS_JS = """
() => {
  const out = [];
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.classList && el.classList.contains('js-plotly-plot') && el.layout) {
        const m = el.layout.meta || {};
        out.push({view: m.view || null, run: el.layout.uirevision || null,
                  title: (el.layout.title && el.layout.title.text) || '',
                  data: (el.data || []).map(t => ({name: t.name || '', x: t.x || null,
                                                   y: t.y || null, z: t.z || null}))});
      }
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return out;
}
"""

pytestmark = [pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workspace: Path, port: int, *extra: str) -> subprocess.Popen:
    """``panel serve apps/dashboard.py`` on 127.0.0.1:port; returns once it answers HTTP."""
    env = {**os.environ, "WORKBENCH_WORKSPACE": str(workspace), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "panel", "serve", "apps/dashboard.py", "--address", "127.0.0.1",
         "--port", str(port), "--allow-websocket-origin", f"127.0.0.1:{port}", *extra],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/static/none", timeout=1)
            return proc
        except urllib.error.HTTPError:  # any HTTP answer: the server is up
            return proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                raise RuntimeError(f"panel serve did not start:\n{out[-3000:]}")
            time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return (out or b"").decode(errors="replace")


def app_tracebacks(log: str) -> str:
    """The server log less tornado's teardown noise: a periodic push that meets the socket the
    closing browser just shut logs a WebSocketClosedError traceback, which is not the app's.
    Any other traceback stays (tests assert there is none)."""
    return re.sub(r"Task exception was never retrieved.*?tornado\.websocket\."
                  r"WebSocketClosedError", "", log, flags=re.S)


def plots(page) -> dict[str, dict]:
    return {p["view"]: p for p in page.evaluate(PLOTS_JS) if p["view"]}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def set_number(page, css: str, value: int) -> None:
    """Type into the text box of an (editable) numeric widget and commit with Enter."""
    box = page.locator(f"{css} input").first
    box.fill(str(value))
    box.press("Enter")


@pytest.fixture()
def browser_page():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium); the browser test needs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1300})
        try:
            yield page
        finally:
            browser.close()


def test_dashboard_runs_in_a_browser(browser_page, embedded_dir, tmp_path):
    t_start = time.time()
    page = browser_page
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    port = _free_port()
    server = start_server(tmp_path / "ws", port)
    log = ""
    try:
        page.goto(f"http://127.0.0.1:{port}/dashboard", wait_until="domcontentloaded")
        before = wait_for(lambda: (lambda p: p if len(p) >= 5 else None)(plots(page)), 30,
                          "the plotly views to render")
        assert before["heatmap"]["data"] == []  # empty workspace: placeholders

        for knob in ("compression", "beta", "lam", "pinned_layers"):  # the VisMMOE card
            assert page.locator(f".wb-vismmoe .wb-knob-{knob}").count() == 1, knob
        set_number(page, ".wb-knob-cache_slots", 9)
        set_number(page, ".wb-knob-max_new_tokens", 6)
        # VisMMOE card: affinity token compression (β, λ, pinned layers at their defaults)
        page.locator(".wb-knob-compression button", has_text="affinity").first.click()
        page.locator(".wb-run button").first.click()

        def new_run():
            p = plots(page)
            h = p.get("heatmap")
            return p if h and h["data"] and h["data"][0]["z"] and p["hit_rate"]["data"] else None

        after = wait_for(new_run, 40, "the heatmap of the new run")
        assert after["heatmap"]["data"] != before["heatmap"]["data"]
        assert after["heatmap"]["run"] and after["heatmap"]["run"].startswith("run-")
        wait_for(lambda: page.locator(".wb-stop button").first.is_disabled(), 30,
                 "the run to finish")
        answer = page.locator("[data-testid=answer]").first.inner_text().strip()
        assert answer and answer not in ("…", "—")

        # the run used the knob that was changed in the page
        store = tmp_path / "ws" / after["heatmap"]["run"]
        attrs = json.loads((store / "zarr.json").read_text())["attributes"]
        assert json.loads(attrs["knob.cache_slots"]) == 9
        assert json.loads(attrs["knob.max_new_tokens"]) == 6
        assert json.loads(attrs["knob.compression"]) == "affinity"
        assert attrs["status"] == "complete"

        # kept vs pruned visual tokens over the image, beside the heatmap
        def overlay():
            t = plots(page).get("tokens")
            cells = {d["name"].split(" ")[0]: len(d["x"] or []) for d in (t or {}).get("data", [])
                     if d["name"].startswith(("kept (", "pruned ("))}
            return cells if t and t["run"] == after["heatmap"]["run"] and cells else None

        cells = wait_for(overlay, 20, "the visual-token overlay of the new run")
        vt = attrs["compression_visual_tokens"]
        assert 0 < vt and cells["kept"] > 0 and cells["pruned"] > 0  # polygons drawn
        assert f"{attrs['compression_kept_visual_tokens']} of {vt} kept" in \
            plots(page)["tokens"]["title"]

        # a view filter redraws without a new run
        page.locator(".wb-filter-modality button", has_text="image").first.click()
        wait_for(lambda: plots(page)["heatmap"]["title"] != after["heatmap"]["title"], 10,
                 "the heatmap to follow the modality filter")
        assert "image tokens" in plots(page)["heatmap"]["title"]

        # the replay view: the new run's recorded routing under other policies, Belady on top;
        # toggling a policy replays (no model run) and redraws the curves
        def replayed():
            r = plots(page).get("replay")
            return r if r and any(t["name"] == "belady (ceiling)" for t in r["data"]) else None

        rep = wait_for(replayed, 20, "the replay curves of the new run")
        assert rep["run"] == after["heatmap"]["run"]
        assert {"lru", "lfu"} <= {t["name"] for t in rep["data"]}
        page.locator(".wb-replay-evictions button", has_text="lfu").first.click()
        wait_for(lambda: plots(page)["replay"]["data"] != rep["data"], 10,
                 "the replay view to follow the policy selection")
        names = {t["name"] for t in plots(page)["replay"]["data"]}
        assert "lfu" not in names and {"lru", "belady (ceiling)"} <= names
        assert "modeled" in page.locator(".wb-replay-table").first.inner_text()

        out = REPO / "test-artifacts"
        out.mkdir(exist_ok=True)
        page.screenshot(path=str(out / "dashboard.png"), full_page=True)
        assert not errors, f"console errors: {errors}"
    finally:
        log = stop_server(server)
    assert "Traceback" not in app_tracebacks(log), log[-3000:]
    assert time.time() - t_start < 60
