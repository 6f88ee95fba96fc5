"""How late does Stop act in the served dashboard? (issues 13 and 37) — *measured*.

Serves the dashboard (``panel serve apps/dashboard.py``, the embedded model), sets
max_new_tokens=300 with ignore_eos, presses Run, presses Stop once the run's store holds 20
steps, and reports how long until the page says the run ended (Run enabled again; goal
≤ 0.5 s) — measured in the page, from the click event to the animation frame with Run enabled,
and as Playwright sees it (it polls every 0.1 s, each poll a round trip to the browser) — the
token the page showed at the click, the token at which Stop reached the server and the one the
run ended at. ``--load N`` runs N busy-looping processes beside the server and the browser
(issue 37: a laptop running a model is that busy). Needs /usr/bin/chromium and playwright (the
browser tests' helpers are reused).

    python benchmarks/bench_stop.py [--repeats 3] [--load 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import busy  # noqa: E402
from test_dashboard_browser import (CHROMIUM, CHROMIUM_ARGS, _free_port, plots,  # noqa: E402
                                    set_number, start_server, stop_server, wait_for)

import workbench  # noqa: E402

#: the status line at the end of a stopped run
PATTERN = r"Stop arrived at token (\d+)\): \S+ · (\d+) tokens"

#: in the page: ``window.__stop.arm()``, then the first click sets ``t0`` (the click event,
#: ``performance.now()`` ms) and ``t1`` is the animation frame after the Run button is enabled
#: again (the page shows the run ended); ``origin``: ``performance.timeOrigin`` (epoch ms)
STOP_JS = """
() => {
  if (window.__stop) return;
  const runButton = () => {
    let found = null;
    const walk = (root, inRun) => {
      for (const el of root.querySelectorAll('*')) {
        if (found) return;
        const here = inRun || (el.classList && el.classList.contains('wb-run'));
        if (here && el.tagName === 'BUTTON') { found = el; return; }
        if (el.shadowRoot) walk(el.shadowRoot, here);
      }
    };
    walk(document, false);
    return found;
  };
  const w = window.__stop = {t0: null, t1: null, armed: false, origin: performance.timeOrigin};
  document.addEventListener('click', () => {
    if (w.armed && w.t0 === null) w.t0 = performance.now();
  }, true);
  w.arm = () => {
    w.t0 = null; w.t1 = null; w.armed = true;
    const tick = () => {
      const b = runButton();
      if (w.t0 !== null && b && !b.disabled) {
        requestAnimationFrame(() => { w.t1 = performance.now(); w.armed = false; });
        return;
      }
      requestAnimationFrame(tick);
    };
    requestAnimationFrame(tick);
  };
}
"""


def one_stop(page, ws: Path) -> dict:
    """Run, wait for 20 stored steps, Stop: the figures of one try."""
    before = set(ws.glob("*.zarr"))
    page.locator(".wb-run button").first.click()
    t_run = time.time()

    def steps() -> int:
        runs = [p for p in ws.glob("*.zarr") if p not in before]
        if not runs:
            return 0
        try:
            return workbench.open_run(runs[0]).sizes.get("step", 0)
        except Exception:  # mid-write: try again
            return 0

    wait_for(lambda: steps() >= 20, 300, "20 steps")
    s_press, t_press = steps(), time.time()
    shown = int(float(page.locator("progress").first.get_attribute("value") or 0))
    stop = page.locator(".wb-stop button").first
    stop.wait_for(state="visible")  # located before the clock starts
    page.evaluate("() => window.__stop.arm()")
    stop.click()
    wait_for(lambda: page.locator(".wb-run button").first.is_enabled(), 300, "Run enabled")
    t_end = time.time()
    page.wait_for_function("() => window.__stop.t1 !== null", timeout=300_000)
    t0, t1, origin = page.evaluate("() => [window.__stop.t0, window.__stop.t1, "
                                   "window.__stop.origin]")
    status = lambda: page.locator(".wb-status").first.inner_text()  # noqa: E731
    wait_for(lambda: re.search(PATTERN, status()), 60, "status line")
    m = re.search(PATTERN, status())
    arrived, ended = int(m.group(1)), int(m.group(2))
    return {"run_to_stop_s": t_press - t_run, "stored_steps": s_press, "shown_token": shown,
            "arrived_token": arrived, "ended_token": ended, "click_to_end_s": t_end - t_press,
            "in_page_s": (t1 - t0) / 1e3, "click_epoch_s": (origin + t0) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="busy-looping processes beside the server (default 0)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    ws = Path(tempfile.mkdtemp(prefix="wb-stop-")) / "ws"
    port = _free_port()
    server = start_server(ws, port)
    tries = []
    try:
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = b.new_page(viewport={"width": 1600, "height": 1300})
            page.set_default_timeout(300_000)
            page.goto(f"http://127.0.0.1:{port}/dashboard", wait_until="domcontentloaded")
            wait_for(lambda: len(plots(page)) >= 5, 120, "views")
            page.evaluate(STOP_JS)
            set_number(page, ".wb-knob-max_new_tokens", 300)
            page.locator(".wb-knob-ignore_eos input").first.check()
            time.sleep(1)
            with busy(args.load):
                for _ in range(args.repeats):
                    tries.append(one_stop(page, ws))
            b.close()
    finally:
        stop_server(server)
        shutil.rmtree(ws.parent, ignore_errors=True)
    ends = [t["click_to_end_s"] for t in tries]
    out = {"load": args.load, "repeats": args.repeats, "tries": tries,
           "click_to_end_median_s": statistics.median(ends),
           "in_page_median_s": statistics.median(t["in_page_s"] for t in tries)}
    if args.json:
        print(json.dumps(out))
        return
    for t in tries:
        print(f"load {args.load}: Stop pressed {t['run_to_stop_s']:.1f} s after Run, the page "
              f"showing token {t['shown_token']} (store: {t['stored_steps']} steps); Stop reached "
              f"the server at token {t['arrived_token']} ({t['arrived_token'] - t['shown_token']} "
              f"after the shown one), the run ended at token {t['ended_token']}; the page showed "
              f"the run ended {t['click_to_end_s']:.2f} s after the click (in the page: "
              f"click event → the frame with Run enabled {t['in_page_s']:.2f} s)")
    print(f"median click → run ended on the page: {out['in_page_median_s']:.2f} s in the page "
          f"(goal ≤ 0.5 s); {out['click_to_end_median_s']:.2f} s seen by Playwright (polls "
          f"every 0.1 s, each a round trip to the browser)")


if __name__ == "__main__":
    main()
