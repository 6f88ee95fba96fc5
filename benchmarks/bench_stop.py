"""How late does Stop act in the served dashboard? (issue 13, item 4) — *measured*.

Serves the dashboard (``panel serve apps/dashboard.py``, the embedded model), sets
max_new_tokens=300 with ignore_eos, presses Run, presses Stop once the run's store holds 20 steps,
and reports how long until the Run/Stop buttons say the run ended, and at which step the store
ended. Needs /usr/bin/chromium and playwright (the browser tests' helpers are reused).

    python benchmarks/bench_stop.py
"""
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_dashboard_browser import (CHROMIUM, CHROMIUM_ARGS, _free_port, start_server, stop_server,
                                    plots, wait_for, set_number)
from playwright.sync_api import sync_playwright
import workbench

ws = Path(tempfile.mkdtemp(prefix="wb-stop-")) / "ws"
port = _free_port()
server = start_server(ws, port)
try:
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = b.new_page(viewport={"width": 1600, "height": 1300})
        page.goto(f"http://127.0.0.1:{port}/dashboard", wait_until="domcontentloaded")
        wait_for(lambda: len(plots(page)) >= 5, 60, "views")
        set_number(page, ".wb-knob-max_new_tokens", 300)
        page.locator(".wb-knob-ignore_eos input").first.check()
        time.sleep(1)
        page.locator(".wb-run button").first.click()
        t_run = time.time()
        # wait until a store with some steps exists
        def steps():
            runs = [p for p in ws.glob("*.zarr")]
            if not runs:
                return 0
            try:
                return workbench.open_run(runs[0]).sizes.get("step", 0)
            except Exception:  # mid-write: try again
                return 0
        wait_for(lambda: steps() >= 20, 120, "20 steps")
        s_press, t_press = steps(), time.time()
        shown = int(float(page.locator("progress").first.get_attribute("value") or 0))
        page.locator(".wb-stop button").first.click()
        wait_for(lambda: page.locator(".wb-run button").first.is_enabled(), 120, "Run enabled")
        t_end = time.time()
        # the status line: "stopped (Stop arrived at token M): run-… · N tokens, …"
        pattern = r"Stop arrived at token (\d+)\): \S+ · (\d+) tokens"
        status = lambda: page.locator(".wb-status").first.inner_text()  # noqa: E731
        wait_for(lambda: re.search(pattern, status()), 30, "status line")
        m = re.search(pattern, status())
        arrived, ended = int(m.group(1)), int(m.group(2))
        print(f"Stop pressed {t_press - t_run:.1f} s after Run, the page showing token {shown} "
              f"(store: {s_press} steps); Stop reached the server at token {arrived} "
              f"({arrived - shown} after the shown one) and the run ended at token {ended} "
              f"({ended - arrived} later); the page showed the run ended (Run enabled again) {t_end - t_press:.2f} s "
              f"after the click")
        b.close()
finally:
    stop_server(server)
    shutil.rmtree(ws.parent, ignore_errors=True)
