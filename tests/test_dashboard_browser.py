"""The dashboard in a real browser: ``panel serve apps/dashboard.py`` + Playwright + Chromium.

Loads the page, changes knobs (affinity token compression in the VisMMOE card among them),
presses Run and waits until the plots show the new run (data read from the plotly elements,
searched through Panel's shadow roots), checks the run used the knobs and that the kept/pruned
visual-token overlay is drawn, that a view filter and the replay view's policy selection redraw
without a new run, that there were no console errors, and saves ``test-artifacts/dashboard.png``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
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


#: the shortest wait: waits catch hangs, never measure speed (a busy machine is slow, and the
#: dashboard rests between redraws under load); speed goals live in benchmarks/
MIN_WAIT_S = 90
#: Playwright's own waits (navigation, clicks), ms
PAGE_TIMEOUT_MS = 180_000


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1, detail=None):
    timeout = max(timeout, MIN_WAIT_S)
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    seen = f"; last seen: {str(detail())[:800]}" if detail is not None else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{seen}")


def selected_options(page) -> list[str]:
    """The text of the selected option of every ``<select>`` of the page (shadow roots too)."""
    return page.evaluate("""() => { const out = [];
        const walk = r => { for (const el of r.querySelectorAll('*')) {
            if (el.tagName === 'SELECT') out.push(el.options[el.selectedIndex]?.text);
            if (el.shadowRoot) walk(el.shadowRoot); } };
        walk(document); return out; }""")


def shown_text(locator) -> str:
    """The text a pane shows: a Panel pane's host (its CSS classes) holds it in its shadow
    root, where ``inner_text`` does not look; "" while the pane is hidden or absent."""
    if not locator.count() or not locator.is_visible():
        return ""
    return locator.evaluate("e => [...(e.shadowRoot || e).children].filter(c => c.tagName "
                            "!== 'STYLE' && c.tagName !== 'LINK').map(c => c.innerText).join(' ')")


def set_number(page, css: str, value: int) -> None:
    """Type into the text box of an (editable) numeric widget and commit with Enter."""
    box = page.locator(f"{css} input").first
    box.fill(str(value))
    box.press("Enter")


class Served:
    """One ``panel serve`` (:func:`start_server`) for the tests of this file: each starts in an
    empty workspace folder (:meth:`fresh`) and a fresh session (a new page), so a test sees only
    its own stores, while the server's start, imports and model load are paid once. The log is
    read as it comes; :meth:`log` is this test's part of it. A test may :meth:`stop` the server
    (the disconnect banner); the next one starts another."""

    def __init__(self, root: Path):
        self.root, self.ws, self.port, self.proc = root, root / "ws", 0, None
        self.lines: list[str] = []
        self.mark = self.seen = self.tests = 0

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line.decode(errors="replace"))

    @contextlib.contextmanager
    def workspace(self):
        """``with served.workspace() as ws``: this test's empty workspace (:meth:`fresh`); a
        test that fails stops the server (a run it started may still be writing)."""
        ws = self.fresh()
        try:
            yield ws
        except BaseException:
            self.stop()
            raise

    def fresh(self) -> Path:
        """An empty workspace (the last test's folder moved aside, a new one made at the
        same path); the server started if it is not running. Returns the workspace."""
        self.tests += 1
        if self.ws.exists():
            self.ws.rename(self.root / f"ws-{self.tests - 1}")
        self.ws.mkdir()
        if self.proc is None or self.proc.poll() is not None:
            self.port = _free_port()
            self.proc = start_server(self.ws, self.port)
            self.lines, self.seen = [], 0
            self.reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
            self.reader.start()
        self.mark = self.seen  # from the last test's check on: nothing between tests is missed
        return self.ws

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/dashboard"

    def log(self) -> str:
        """The server's log since the last test's check (all the rest of it once stopped)."""
        self.seen = len(self.lines)
        return "".join(self.lines[self.mark:self.seen])

    def stop(self) -> str:
        """Stop the server; its log since the last test's check."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(10)
            self.proc = None
        return self.log()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("served"))
    yield s
    s.mark = s.seen
    log = s.stop()  # the rest of the log: a traceback after the last test's end too
    assert "Traceback" not in app_tracebacks(log), log[-3000:]


@pytest.fixture(scope="module")
def chromium():
    """One Chromium for the tests of this file; each test gets its own context (page)."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium); the browser test needs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture()
def browser_page(chromium):
    """A page of a fresh browser context (no state from an earlier test), 1600 × 1300."""
    context = chromium.new_context(viewport={"width": 1600, "height": 1300},
                                   accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    try:
        yield page
    finally:
        context.close()


def test_dashboard_runs_in_a_browser(browser_page, served, embedded_dir):
    page = browser_page
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    with served.workspace() as ws:
        page.goto(served.url, wait_until="domcontentloaded")
        before = wait_for(lambda: (lambda p: p if len(p) >= 5 else None)(plots(page)), 30,
                          "the plotly views to render")
        assert before["heatmap"]["data"] == []  # empty workspace: placeholders

        for knob in ("compression", "beta", "lam", "alpha"):  # the VisMMOE card
            assert page.locator(f".wb-vismmoe-card .wb-knob-{knob}").count() == 1, knob
        set_number(page, ".wb-knob-cache_slots", 9)
        set_number(page, ".wb-knob-max_new_tokens", 6)
        # VisMMOE card: affinity token compression (β, λ at their defaults)
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
        # the end is shown before the store's final write; the status line says when it is on
        # disk (the note goes)
        wait_for(lambda: "writing the store" not in
                 page.locator(".wb-status").first.inner_text(), 30, "the store written")
        answer = page.locator("[data-testid=answer]").first.inner_text().strip()
        assert answer and answer not in ("…", "—")

        # the run used the knob that was changed in the page
        store = ws / after["heatmap"]["run"]
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

        # expert parallel: the card's ep_ranks spreads the shown run over virtual ranks (the
        # EP view redraws from the recorded routing; nothing reruns)
        assert "ep_ranks = 1" in page.locator(".wb-ep").first.inner_text() or \
            plots(page)["ep"]["data"] == []
        page.locator(".wb-card-title", has_text="Expert parallel").first.click()
        set_number(page, "#sidebar .wb-knob-ep_ranks", 4)

        def ep_bars():
            e = plots(page).get("ep")
            bars = [d for d in (e or {}).get("data", []) if d["name"].endswith("tokens")]
            return bars if bars and len(bars[0]["x"] or []) == 4 else None

        bars = wait_for(ep_bars, 20, "the EP view over 4 ranks")
        assert {b["name"] for b in bars} == {"text tokens", "image tokens"}
        assert "EP over 4 ranks" in plots(page)["ep"]["title"]
        # and the modeled EP clock of the step as lanes: dispatch, the 4 ranks, combine
        tl = wait_for(lambda: (plots(page).get("ep_timeline") or {}).get("data") or None, 20,
                      "the EP timeline over 4 ranks")
        lanes = {y for d in tl if d["name"] == "expert compute" for y in d["y"]}
        assert lanes == {f"rank {r}" for r in range(4)}
        assert "modeled EP clock of step" in plots(page)["ep_timeline"]["title"]
        # ReaLB (issue 15 §5): the card's balance draws M_d per rank over the shown run's
        # routing (modeled: this run had no controller)
        page.locator("#sidebar .wb-knob-balance select").first.select_option("realb-m1")

        def realb_lines():
            r = plots(page).get("realb") or {}
            lines = [d for d in r.get("data", []) if re.fullmatch(r"rank \d+", d["name"])]
            return lines if len(lines) == 4 else None

        wait_for(realb_lines, 20, "the ReaLB view over 4 ranks",
                 detail=lambda: plots(page).get("realb"))
        assert "M_d per rank" in plots(page)["realb"]["title"]

        out = REPO / "test-artifacts"
        out.mkdir(exist_ok=True)
        page.screenshot(path=str(out / "dashboard.png"), full_page=True)
        assert not errors, f"console errors: {errors}"
    log = served.log()
    assert "Traceback" not in app_tracebacks(log), log[-3000:]


#: bounding boxes of the plotly views (shadow roots included), in viewport pixels
BOXES_JS = """
() => {
  const out = {};
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.classList && el.classList.contains('js-plotly-plot') && el.layout) {
        const r = el.getBoundingClientRect();
        const v = (el.layout.meta || {}).view;
        if (v) out[v] = {top: r.top, bottom: r.bottom, left: r.left, right: r.right};
      }
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return out;
}
"""


def test_a_researchers_first_screen_at_1440x900(chromium, embedded_dir, tmp_path):
    """Issue 13 in a real browser at a laptop's 1440 × 900: the first screen shows the newest
    usable run with its own demo request selected (expected answer checked, input image shown),
    hit rate, latency and timeline above the fold; an abandoned store is listed as such; a knob
    combination a live run refuses keeps the shown run and says why; A/B names the knob that
    differs; Export downloads the run's tables; a dropped server connection is announced."""
    import zipfile

    from workbench.ui.datastore import DataStore, demo_inputs

    ws = tmp_path / "ws"
    s = DataStore(workspace=ws)
    demo = demo_inputs()[1]
    s.use_demo(demo)
    s.knobs.set(max_new_tokens=8)
    s.start_run(name="shown")
    s.wait()
    assert not s.error, s.error
    # a newer store whose run failed before committing a step: listed, never opened at start
    dead = ws / "dead.zarr"
    shutil.copytree(ws / "shown.zarr", dead)
    meta = json.loads((dead / "zarr.json").read_text())
    meta["attributes"].update(status="failed", error="RuntimeError: out of memory",
                              committed={k: 0 for k in meta["attributes"]["committed"]})
    (dead / "zarr.json").write_text(json.dumps(meta))

    # its own server (not the file's shared one): it stops it to see the disconnect banner
    port = _free_port()
    server = start_server(ws, port)
    log = ""
    try:
        with contextlib.closing(chromium.new_context(  # the file's Chromium, its own context
                viewport={"width": 1440, "height": 900}, accept_downloads=True)) as context:
            page = context.new_page()
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            page.goto(f"http://127.0.0.1:{port}/dashboard", wait_until="domcontentloaded")
            first = wait_for(lambda: (lambda p: p if p.get("heatmap", {}).get("data") else None)(
                plots(page)), 30, "the shown run's heatmap")
            assert first["heatmap"]["run"] == "shown.zarr"
            # the first screen: the shown run, its demo request selected, the four plots
            assert "newest run of the workspace" in page.locator(".wb-status").first.inner_text()
            chosen = selected_options(page)
            assert demo["label"] in chosen, chosen
            assert page.locator("[data-testid=expected]").count() == 1
            assert page.locator("[data-testid=answer-image]").count() == 1
            boxes = page.evaluate(BOXES_JS)
            for view in ("heatmap", "hit_rate", "latency", "timeline"):
                assert boxes[view]["top"] >= 0 and boxes[view]["bottom"] <= 900, (view, boxes)
                assert boxes[view]["right"] <= 1440, (view, boxes)
            # the abandoned store, listed with its reason
            listed = " ".join(o for o in page.evaluate("""() => { const out = [];
                const walk = r => { for (const el of r.querySelectorAll('option')) out.push(el.text);
                    for (const el of r.querySelectorAll('*')) if (el.shadowRoot) walk(el.shadowRoot); };
                walk(document); return out; }"""))
            assert "dead · abandoned (failed: RuntimeError: out of memory)" in listed, listed

            # Export: the shown run's tables in one click
            with page.expect_download() as dl:
                page.locator(".wb-export a, .wb-export button").first.click()
            with zipfile.ZipFile(dl.value.path()) as z:
                assert any(n.endswith(".csv") for n in z.namelist()), z.namelist()

            # a combination a live run refuses (vismmoe prefetch, no predictor calibrated in
            # this workspace): refused before anything loads, said, the shown run stays
            page.locator(".wb-card-title", has_text="Prefetch").first.click()
            # the card builds its widgets when opened (the replay card below has its own)
            page.locator("#sidebar .wb-knob-prefetch select").first.select_option("vismmoe")
            page.locator(".wb-run button").first.click()
            try:
                wait_for(lambda: page.get_by_text("holds no calibrated predictor").count(), 20,
                         "the refusal, where the user looks")
            except AssertionError:
                page.screenshot(path=str(tmp_path / "refusal.png"))
                shutil.copy(tmp_path / "refusal.png", "/tmp/refusal.png")
                raise
            # the shown run stays (or is back within a poll: on 2 busy cores the plots may
            # redraw after the refusal is shown)
            wait_for(lambda: plots(page)["heatmap"]["run"] == "shown.zarr", 10,
                     "the shown run after the refusal")
            page.locator("#sidebar .wb-knob-prefetch select").first.select_option("none")

            page.locator(".wb-pin button").first.click()
            wait_for(lambda: page.locator("[data-testid=ab-differs]").count() > 0 or
                     "Pin a run" not in page.locator(".wb-ab-names").all_inner_texts(), 10,
                     "the baseline pinned")
            set_number(page, ".wb-knob-cache_slots", 20)
            page.locator(".wb-run button").first.click()
            wait_for(lambda: page.locator(".wb-run button").first.is_enabled() and
                     plots(page)["heatmap"]["run"] != "shown.zarr", 60, "the second run")
            differs = wait_for(lambda: (lambda t: t if "cache_slots" in t else None)(" ".join(
                page.locator("[data-testid=ab-differs]").all_inner_texts())), 20,
                "the A/B card of the new run")
            assert "cache_slots" in differs and "20" in differs, differs
            # measured latency: a median over repeats; one run a side says its noise is unknown
            assert page.locator("[data-testid=ab-noise]").first.inner_text().strip() == \
                "(one run: noise unknown, run it again)"

            # the replay table fits the main column (no sideways scrolling at 1440 px)
            wait_for(lambda: page.locator(".wb-replay-table tbody tr").count() > 0, 30,
                     "the replay table")
            sw, cw = page.locator(".wb-replay-table").first.evaluate(
                "t => [t.parentElement.scrollWidth, t.parentElement.clientWidth]")
            assert sw <= cw + 1, (sw, cw)

            # the server goes away: the page says so
            stop_server(server)
            server = None
            wait_for(lambda: page.get_by_text("Connection to the workbench server lost").count(),
                     20, "the disconnect banner")
    finally:
        if server is not None:
            log = stop_server(server)
    assert "Traceback" not in app_tracebacks(log), log[-3000:]


def test_elastic_experts_and_the_scheduler_in_a_browser(browser_page, served, embedded,
                                                        tmp_path):
    """Issue 16 §5 in a real browser: the shown run ran sub-experts (k_active 2 of 4); the
    Elastic experts card draws its sub-expert heatmap and compute share, and the measured
    operating points with the next run's k_active starred — the card's slider moves the star,
    the layer slider the heatmap; the scheduler view's arrival rate re-simulates."""
    import workbench
    from workbench.prism import refactor as R

    page = browser_page
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    R.save(R.random_refactoring(embedded), tmp_path / "prism")
    with served.workspace() as ws:
        workbench.Runtime(embedded, max_new_tokens=4, ignore_eos=True).run(
            workbench.mixed_batch(2), store=ws / "p.zarr", prism=True, prism_k_active=2,
            prism_refactoring=str(tmp_path / "prism"))
        page.goto(served.url, wait_until="domcontentloaded")
        heat = wait_for(lambda: (lambda h: h if h.get("data") and h["data"][0]["z"] else None)(
            plots(page).get("subexperts") or {}), 40, "the sub-expert heatmap of the shown run")
        assert heat["run"].startswith("p.zarr") and len(heat["data"][0]["z"]) == 4  # N rows
        assert "50.0%" in page.locator("[data-testid=prism-share]").first.inner_text()

        def star():
            p = plots(page).get("prism_points") or {}
            return next(((d["x"][0], d["name"]) for d in p.get("data", [])
                         if d["name"].startswith("next run")), None)

        assert wait_for(star, 20, "the next run's k_active on the curve")[0] == 1.0  # all
        set_number(page, ".wb-prism .wb-knob-prism_k_active", 1)
        wait_for(lambda: star() and star()[0] == 0.25, 10, "the star at k_active 1 of 4",
                 detail=star)
        set_number(page, ".wb-prism-layer", 3)
        wait_for(lambda: "layer 3" in plots(page)["subexperts"]["title"], 10,
                 "the heatmap of layer 3", detail=lambda: plots(page)["subexperts"]["title"])
        assert plots(page)["subexperts"]["data"][0]["z"] != heat["data"][0]["z"]

        def sweep():
            d = (plots(page).get("scheduler") or {}).get("data") or []
            return {t["name"]: t["x"] for t in d if t["name"].endswith(" throughput")} or None

        before = wait_for(sweep, 30, "the scheduler's simulated policies")
        assert set(before) == {"prism throughput", "fifo throughput", "fullbatch throughput"}
        note = page.locator("[data-testid=scheduler-note]").first.inner_text()
        assert "cost table C(m, b) modeled" in note, note
        set_number(page, ".wb-scheduler .wb-knob-rate", 1.23)
        wait_for(lambda: 1.23 in (sweep() or {}).get("prism throughput", []), 20,
                 "the scheduler to re-simulate at 1.23 req/s", detail=sweep)
        assert not errors, f"console errors: {errors}"
    log = served.log()
    assert "Traceback" not in app_tracebacks(log), log[-3000:]
#: what the page shows that could be cut off or covered, through shadow roots: per plotly view
#: the boxes of the figure, its title, legend, toolbar, axis titles and annotations; per table
#: of a card (.wb-scheduler, .wb-compare, .wb-replay, .wb-answer-box) its box and the card's
LAYOUT_JS = """
() => {
  const out = {plots: {}, tables: []};
  const R = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const CARDS = ['wb-scheduler', 'wb-compare', 'wb-replay', 'wb-answer-box'];
  const walk = (root, card) => {
    for (const el of root.querySelectorAll('*')) {
      let c = card;
      if (el.classList && CARDS.some(k => el.classList.contains(k))) c = el;
      if (el.classList && el.classList.contains('js-plotly-plot') && el.layout &&
          el.getBoundingClientRect().width > 0) {
        const all = s => [...el.querySelectorAll(s)].map(R);
        out.plots[(el.layout.meta || {}).view || '?'] = {
          plot: R(el), title: all('.gtitle'), legend: all('.legend'), modebar: all('.modebar'),
          xtitles: all('[class^=g-x][class$=title]'), ytitles: all('[class^=g-y][class$=title]'),
          notes: all('.annotation')};
      }
      if (el.tagName === 'TABLE' && c) out.tables.push({cls: el.className, box: R(el), card: R(c)});
      if (el.shadowRoot) walk(el.shadowRoot, c);
    }
  };
  walk(document, null);
  return out;
}
"""


def _overlap(a, b) -> bool:
    return a[0] < b[2] - 1 and b[0] < a[2] - 1 and a[1] < b[3] - 1 and b[1] < a[3] - 1


def layout_blemishes(page) -> list[str]:
    """What :data:`LAYOUT_JS` finds cut off or covered: a title past its figure's edges, a
    legend on an axis title, the toolbar on a y-axis title, a note (subtitle) on an axis title,
    a table wider than its card. Empty when the page is tidy."""
    found = []
    lay = page.evaluate(LAYOUT_JS)
    for view, p in lay["plots"].items():
        box = p["plot"]
        for t in p["title"]:
            if t[0] < box[0] - 1 or t[2] > box[2] + 1 or t[1] < box[1] - 1:
                found.append(f"{view}: title {t} outside the figure {box}")
        axes = p["xtitles"] + p["ytitles"]
        if any(_overlap(a, g) for a in axes for g in p["legend"]):
            found.append(f"{view}: the legend covers an axis title")
        if any(_overlap(a, m) for a in p["ytitles"] for m in p["modebar"]):
            found.append(f"{view}: the toolbar covers a y-axis title")
        if any(_overlap(a, t) for a in p["ytitles"] for t in p["title"] + p["notes"]):
            found.append(f"{view}: the title or a note covers a y-axis title")
    for t in lay["tables"]:
        if t["box"][2] > t["card"][2] + 1 or t["box"][0] < t["card"][0] - 1:
            found.append(f"table {t['cls']!r} {t['box']} is wider than its card {t['card']}")
    return found


def _stores(ws: Path) -> set[str]:
    return {p.name for p in ws.glob("*.zarr")}


def test_refusals_a_batch_an_upload_and_a_tidy_page(browser_page, served, embedded_dir,
                                                    tmp_path):
    """Issue 37 §2–5 and §8 in one page at a laptop's 1440 × 900: a value a knob refuses is
    said under its widget, Run then says so and stores nothing, and the alert goes once the
    value is fixed; a batch lists every answer with its expected one; a run the loaded model
    refuses says nothing was stored; Run right after an upload either waits for it ("still
    uploading") or runs the uploaded image, never the demo's; a file that is no image is
    refused with no "Upload complete" beside it; and nothing on the page is cut off or covered
    (:func:`layout_blemishes`: titles, legends, toolbars, tables), a pinned baseline's
    legends included."""
    from PIL import Image

    page = browser_page
    page.set_viewport_size({"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    error = page.locator(".wb-error").first
    run = page.locator(".wb-run button").first
    status = page.locator(".wb-status").first

    def finished(what: str) -> None:
        wait_for(lambda: run.is_enabled() and page.locator(".wb-stop button").first.is_disabled()
                 and "writing the store" not in status.inner_text(), 120, what)

    with served.workspace() as ws:
        page.goto(served.url, wait_until="domcontentloaded")
        wait_for(lambda: len(plots(page)) >= 5, 60, "the plotly views to render")

        # §2: a refused value stays in its box, said under it; Run says so and stores nothing
        set_number(page, ".wb-knob-cache_slots", 0)
        refused = page.locator(".wb-refused-cache_slots").first
        wait_for(lambda: refused.is_visible() and "refused" in shown_text(refused), 20,
                 "the refusal under the cache slots box")
        run.click()
        wait_for(lambda: error.is_visible() and "cache_slots box" in shown_text(error), 20,
                 "Run refused while the box holds the value")
        assert not _stores(ws)
        set_number(page, ".wb-knob-cache_slots", 16)
        wait_for(lambda: not error.is_visible() and not refused.is_visible(), 20,
                 "the alerts to go once the value is fixed")

        # §5: a batch of 3 lists every answer, with the expected ones
        set_number(page, ".wb-knob-max_new_tokens", 6)
        set_number(page, ".wb-batch-size", 3)
        run.click()
        finished("the batch run")
        batch = page.locator("[data-testid=batch]").first
        wait_for(lambda: batch.locator("tr td").count() > 0, 30, "the batch's answers")
        assert batch.locator("tr").count() == 1 + 3  # a header, a row a request
        assert batch.locator("td[data-match]").count() >= 1
        (batch_run,) = _stores(ws)
        page.locator(".wb-pin button").first.click()  # the baseline of the legends below
        set_number(page, ".wb-batch-size", 1)

        # §4: a run the loaded model refuses (the model at bfloat16 is not loaded when Run is
        # pressed, so the thread finds it): nothing stored, the batch run shown again
        page.locator(".wb-card-title", has_text="Execution").first.click()
        page.locator("#sidebar .wb-knob-dtype select").first.select_option("bfloat16")
        set_number(page, ".wb-knob-pinned_layers", 40)
        run.click()
        wait_for(lambda: "nothing stored" in status.inner_text(), 120,
                 "the refused run's page", detail=status.inner_text)
        assert batch_run[:-5] in status.inner_text() and _stores(ws) == {batch_run}
        # the alert comes in the same server callback as the status, but the page may draw it
        # a frame later (seen once under load: read empty right after the status showed)
        wait_for(lambda: "pinned_layers" in shown_text(error), 30, "the refusal's alert",
                 detail=lambda: shown_text(error))
        set_number(page, ".wb-knob-pinned_layers", 1)
        page.locator("#sidebar .wb-knob-dtype select").first.select_option("float32")

        # §3: Run at once after an upload is refused while it arrives, then runs the upload.
        # The worst instant: the file is in FilePond's list but its entry not yet drawn (a
        # frame or more later; under load a click once fell there and ran the demo image), so
        # the file goes in and Run is clicked in one task of the page
        png = tmp_path / "mine.png"
        Image.new("RGB", (64, 48), (200, 30, 30)).save(png)
        page.evaluate("""([root, button, data]) => {
          const bytes = Uint8Array.from(atob(data), c => c.charCodeAt(0));
          window.FilePond.find(root).addFile(new File([bytes], 'mine.png', {type: 'image/png'}));
          button.click();
        }""", [page.locator(".wb-upload .filepond--root").first.element_handle(),
               run.element_handle(), base64.b64encode(png.read_bytes()).decode()])
        # the server handles the click before the upload's end, which the menu then names; the
        # "still uploading" alert of the refused Run goes at that end (its cause is gone)
        wait_for(lambda: "(uploaded) mine.png" in selected_options(page), 30,
                 "the menu to name the upload")
        finished("the refused Run")
        assert _stores(ws) == {batch_run}, "Run started while the image was on its way"
        run.click()
        wait_for(lambda: _stores(ws) != {batch_run}, 30, "the run of the upload",
                 detail=lambda: (shown_text(error), status.inner_text()))
        finished("the run of the uploaded image")
        (new,) = _stores(ws) - {batch_run}
        attrs = json.loads((ws / new / "zarr.json").read_text())["attributes"]
        (image,) = json.loads(attrs["images"])
        assert Path(image).parent == ws / "uploads", image

        # §8: a file that is no image: refused, and FilePond's "Upload complete" not beside it
        fake = tmp_path / "fake.png"
        fake.write_bytes(b"not an image at all")
        page.locator(".wb-upload input[type=file]").first.set_input_files(str(fake))
        message = page.locator(".wb-upload-message").first
        wait_for(lambda: message.is_visible() and "fake.png" in shown_text(message), 30,
                 "the fake image refused")
        wait_for(lambda: not page.get_by_text("Upload complete").first.is_visible(), 10,
                 "no 'Upload complete' beside the refusal")

        # §8: nothing cut off or covered, the pinned baseline's legends and the tables below
        # included (the replay and scheduler tables come once the page is drawn)
        wait_for(lambda: page.locator(".wb-scheduler-table").count() and
                 page.locator(".wb-replay-table tbody tr").count(), 60, "the tables below")
        wait_for(lambda: any(d["name"].startswith("baseline") for d in
                             plots(page)["latency"]["data"]), 20, "the baseline's latency")
        page.locator(".wb-card-title", has_text="Compare runs").first.click()
        picker = page.locator(".wb-compare-runs input").first
        for _ in range(2):
            picker.click()
            page.keyboard.press("Enter")
        wait_for(lambda: page.locator(".wb-compare-table").count(), 30, "the compare table")
        page.keyboard.press("Escape")
        assert layout_blemishes(page) == []
        mix, size = (page.locator(f"{c} label").first.bounding_box()
                     for c in (".wb-batch-mix", ".wb-batch-size"))
        assert size["x"] + size["width"] <= mix["x"], (size, mix)  # the labels apart
        stop, bar = (page.locator(c).first.bounding_box() for c in (".wb-stop", "#sidebar"))
        assert stop["x"] + stop["width"] <= bar["x"] + bar["width"], (stop, bar)
        out = REPO / "test-artifacts"
        out.mkdir(exist_ok=True)
        page.screenshot(path=str(out / "dashboard-1440.png"))
        assert not errors, f"page errors: {errors}"
    log = served.log()
    assert "Traceback" not in app_tracebacks(log), log[-3000:]
