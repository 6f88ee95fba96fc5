"""The dashboard app: wires widgets (``widgets.py``) and views (``views.py``) to one
:class:`~workbench.ui.datastore.DataStore` per browser session.

``build_app()`` returns a ``BootstrapTemplate`` (``template=False``: a plain layout for a
notebook). All state and logic live in the DataStore; this module holds layout only, plus the
periodic callback that lets the store pick up a run's progress (``DataStore.poll``) on the
Bokeh event loop. ``serve()`` runs it on ``127.0.0.1`` by default.
"""

from __future__ import annotations

import html
import json
import logging
import socket
from pathlib import Path
from typing import Any

import panel as pn

from workbench.errors import WorkbenchError
from workbench.ui import warm
from workbench.ui.datastore import DataStore
from workbench.ui.prism import (OperatingPointsView, SchedulerView, SubexpertView,
                                prism_knob_widgets)
from workbench.ui.views import (CompareView, DeltasView, DiffHeatmapView, EPTimelineView, EPView,
                                HeatmapView, HitRateView, HotRecallView, LatencyView, ReaLBView,
                                ReplayView, TickQueue, TimelineView, TokenOverlayView,
                                answer_view, progress_view)
from workbench.ui.widgets import (card, filter_widgets, input_widgets, knob_cards, make,
                                  model_widgets, replay_widgets, runs_widgets)

__all__ = ["build_app", "serve", "STYLE", "TITLE"]

log = logging.getLogger(__name__)

TITLE = "workbench · offloaded MoE inference"
#: poll period of the periodic callback, ms (run progress and live tail)
POLL_MS = 200
#: height of the four plots of the first screen, px (two rows fit 1440 × 900 with the answer)
PLOT_H = 280
#: sidebar width, px
SIDEBAR_W = 380
#: readable runs tried, newest first, for the run shown when a session starts
OPEN_LATEST_TRIES = 3

#: styles of the HTML panes (Panel renders into shadow roots, so they are passed per pane)
STYLE = """
.wb-muted { color: #6b7280; }
.wb-status { color: #374151; font-size: 13px; }
.wb-label { color: #374151; font-size: 12px; font-weight: 600; margin-bottom: 2px; }
.wb-answer { padding: 2px 4px; }
.wb-answer-text { font-size: 17px; font-weight: 600; color: #111827; min-height: 24px;
                  max-height: 72px; overflow-y: auto; white-space: pre-wrap; }
.wb-expected { font-size: 13px; color: #374151; }
.wb-expected[data-match='true'] { color: #047857; }
.wb-expected[data-match='false'] { color: #b91c1c; }
table.wb-ab { border-collapse: collapse; width: 100%; font-size: 13px; }
table.wb-ab th, table.wb-ab td { padding: 4px 10px; border-bottom: 1px solid #e5e7eb;
                                 text-align: right; white-space: nowrap; }
.wb-ab-names { font-size: 12px; margin-bottom: 6px; }
table.wb-ab th:first-child, table.wb-ab td:first-child { text-align: left; }
table.wb-ab th { color: #374151; font-weight: 600; vertical-align: bottom; }
td.wb-good { color: #047857; font-weight: 600; }
/* the tables of the main column (replay, scheduler, compare) fit their card: headers wrap,
   cells stay on one line, and a table still too wide scrolls inside its box (.wb-fit-box),
   never past the card */
table.wb-fit { font-size: 12px; table-layout: auto; }
table.wb-fit th { white-space: normal; min-width: 56px; padding: 4px 6px; }
table.wb-fit td { padding: 3px 6px; }
.wb-fit-box { overflow-x: auto; max-width: 100%; }
td.wb-bad { color: #b91c1c; font-weight: 600; }
/* a batch's answers: scrolls inside the answer card, cells wrap (never wider than the card) */
.wb-batch summary { font-size: 13px; color: #374151; cursor: pointer; }
.wb-batch-rows { max-height: 180px; overflow: auto; }
table.wb-batch-table td, table.wb-batch-table th { white-space: normal; text-align: left; }
"""

#: the Run button's click, in the browser: the request to run (a fresh value each click) and
#: the name of an image still uploading, if any (FilePond's list of files and its file input,
#: through shadow roots)
RUN_JS = """
// FilePond's FileStatus: PROCESSING_COMPLETE 5, PROCESSING_ERROR 6, LOAD_ERROR 8,
// PROCESSING_REVERT_ERROR 10; any other status is a file still arriving
const done = [5, 6, 8, 10];
const busy = [];
const walk = (root) => {
  for (const el of root.querySelectorAll('*')) {
    const pond = el.classList && el.classList.contains('filepond--root') && window.FilePond
      ? window.FilePond.find(el) : null;
    // FilePond's own list, not its drawn entries: a chosen file leaves the input and enters the
    // list in one task, but its entry is drawn a frame or more later (a Run clicked in that gap
    // under load once ran the demo image)
    if (pond)
      for (const f of pond.getFiles())
        if (!done.includes(f.status)) busy.push(f.filename || 'the image');
    // a file chosen, not yet taken in by FilePond (it takes files 250 ms after the change)
    if (el.classList && el.classList.contains('filepond--browser') && el.files && el.files.length)
      busy.push(el.files[0].name);
    if (el.shadowRoot) walk(el.shadowRoot);
  }
};
walk(document);
req.value = JSON.stringify({at: Date.now() + Math.random(), uploading: busy[0] || null});
"""

pn.extension("plotly", "filedropper", notifications=True,
             disconnect_notification="Connection to the workbench server lost: runs in flight "
                                     "go on and are stored; reload the page to see them.")


def _styled(*objs: Any) -> None:
    for o in objs:
        o.stylesheets = [*o.stylesheets, STYLE]


def _labelled(label: str, widget: Any, **kw: Any) -> pn.Column:
    head = pn.pane.HTML(f"<div class='wb-label'>{label}</div>", margin=(0, 10), height=18)
    _styled(head)
    return pn.Column(head, widget, margin=(0, 4), **kw)


def build_app(store: DataStore | None = None, *, template: bool = True,
              poll_ms: int = POLL_MS, preload: bool = True, open_latest: bool = True,
              demo_folder: str | Path | None = None) -> Any:
    """The dashboard for one session. ``store`` defaults to a fresh :class:`DataStore` on the
    workspace (``$WORKBENCH_WORKSPACE`` or ``runs/``) and the embedded model; ``preload``
    loads the model in the background so the first Run starts fast; ``open_latest`` shows the
    newest run of the workspace at start."""
    store = store if store is not None else DataStore()
    served = pn.state.curdoc is not None
    if preload:  # after the page has rendered: the import of torch holds the GIL a while
        if pn.state.curdoc is not None:
            # then the replay kernels, compiled in a child (not on the event loop), once the
            # model is loaded: started before it, the child made the first page 2 s slower
            # under load (bench_dashboard.py --load 2). `--warm` runs onload at server start
            pn.state.onload(lambda: store.preload(then=warm.start))
        else:
            store.preload()
    if open_latest and store.dataset is None:
        # the newest readable run; an unreadable one is listed with its reason, never raised
        for info in [r for r in store.runs if r.readable and not r.abandoned][:OPEN_LATEST_TRIES]:
            try:
                store.open(info.name)
                store.status = f"newest run of the workspace · {store.status}"
                break
            except Exception as e:
                log.info("could not open run %s: %s", info.name, e)

    # -- left: request, knobs, run control, runs -------------------------------------------
    inp = input_widgets(store, demo_folder)
    run_b = make(pn.widgets.Button, "▶ Run", "success", sizing_mode="stretch_width",
                 height=40, css_classes=["wb-run"])
    stop_b = make(pn.widgets.Button, "■ Stop", "danger", width=110, height=40, disabled=True,
                  css_classes=["wb-stop"])
    error = pn.pane.Alert("", alert_type="danger", visible=False, sizing_mode="stretch_width",
                          css_classes=["wb-error"],
                          stylesheets=[".alert { overflow-wrap: anywhere; }"])

    def on_run(event: Any) -> None:
        try:
            store.start_run(name=inp["run_name"].value.strip() or None)
            inp["run_name"].value = ""
        except WorkbenchError as e:
            store.error = str(e)
        except Exception as e:  # never into Panel: say what happened
            log.exception("run could not start")
            store.error = f"the run could not start: {type(e).__name__}: {str(e)[:300]}"

    def on_running(*events: Any) -> None:
        run_b.disabled = store.running
        stop_b.disabled = not store.running

    def on_error(*events: Any) -> None:
        error.param.update(object=html.escape(store.error), visible=bool(store.error))

    # Run asks through the browser, in one message with whether an image upload is still on its
    # way there (a FilePond entry not yet complete): the server hears of an upload only at its
    # first chunk, and a Run pressed right after the drop reached it first and ran the image
    # shown before (the browser test's "upload, then Run at once")
    run_request = pn.widgets.TextInput(visible=False, css_classes=["wb-run-request"])

    def on_request(event: Any) -> None:
        try:
            uploading = json.loads(event.new).get("uploading")
        except (ValueError, AttributeError):
            return
        if uploading:  # refused by start_run: "… is still uploading"
            store.upload_on_its_way(str(uploading))
        on_run(event)

    run_request.param.watch(on_request, "value")
    run_b.js_on_click(args={"req": run_request}, code=RUN_JS)
    stop_b.on_click(lambda e: store.stop())
    # answered in the browser at once: the server's callback may wait behind a redraw
    stop_b.js_on_click(args={"b": stop_b}, code="b.disabled = true")
    store.param.watch(on_running, "running")
    store.param.watch(on_error, "error")

    runs = runs_widgets(store)
    models = model_widgets(store)
    request = card(
        models["model"], models["other"], models["message"],
        inp["demo"], inp["preview"], inp["upload_hint"], inp["upload"], inp["upload_message"],
        inp["prompt"], pn.Row(inp["batch_size"], inp["batch_mix"], sizing_mode="stretch_width"),
        inp["run_name"],
        title="Request", collapsible=False)
    runs_card = card(
        runs["select"], pn.Row(runs["open"], runs["refresh"], runs["adopt"]),
        pn.Row(runs["pin"], runs["clear"], sizing_mode="stretch_width"), runs["baseline"],
        runs["export"], runs["message"], runs["problems"],
        title="Runs", collapsible=False)
    _styled(inp["upload_hint"], runs["baseline"])
    # (run_request: hidden, outside the Row: a hidden child there still took its share)
    sidebar = [request, pn.Row(run_b, stop_b), run_request, error, *knob_cards(store.knobs),
               runs_card]

    # -- right: progress and answer, filters, plots, A/B -------------------------------------
    filt = filter_widgets(store)
    # one line of filters at 1440 px (sidebar 380): 200 + 230 + 250 + 190 + 3 gaps of 16
    filters = pn.FlexBox(_labelled("heatmap tokens", filt["modality"], width=200),
                         _labelled("phase", filt["phase"], width=230),
                         _labelled("step range", filt["steps"], width=250),
                         _labelled("timeline clock", filt["clock"], width=190),
                         flex_wrap="wrap", gap="0 16px", sizing_mode="stretch_width")
    # the first screen (1440 × 900: 62 px header, ≈ 838 px of main column): answer (≈ 130),
    # filters (≈ 60), then two rows of PLOT_H: heatmap | hit rate, latency | timeline
    heat, hit, lat, tl = (HeatmapView(store, height=PLOT_H), HitRateView(store, height=PLOT_H),
                          LatencyView(store, height=PLOT_H), TimelineView(store, height=PLOT_H))
    # VisMMOE: kept vs pruned visual tokens, Hot Recall (the row under the first screen)
    tokens, recall = TokenOverlayView(store), HotRecallView(store)
    ep, ep_tl = EPView(store), EPTimelineView(store, height=340)
    realb = ReaLBView(store, height=340)
    ep_card = card(ep.pane, ep_tl.pane, realb.pane,
                   title="Expert parallel: the shown run's routing over ranks (virtual; ranks "
                         "and placement from the Expert parallel card)",
                   margin=(4, 4), css_classes=["wb-ep"])
    # MoE-Prism: the Elastic experts knobs beside the measured operating points (k_active
    # marked), the shown run's sub-experts under them; the QoS scheduler simulation
    points, subs = OperatingPointsView(store, height=380), SubexpertView(store, height=280)
    prism_knobs = prism_knob_widgets(store, points.points and points.points["subexperts"])
    _styled(subs.note)
    prism_card = card(
        pn.Row(pn.Column(prism_knobs, width=320, margin=(0, 4)), points.pane,
               sizing_mode="stretch_width"),
        pn.FlexBox(pn.Column(subs.note, min_width=420, sizing_mode="stretch_width"),
                   pn.Column(subs.layer, width=300), flex_wrap="wrap",
                   sizing_mode="stretch_width"),
        subs.pane,
        title="Elastic experts (MoE-Prism): the next run's k_active on the measured operating "
              "points · the shown run's sub-experts", margin=(4, 4), css_classes=["wb-prism"])
    sched = SchedulerView(store, defer=served)
    _styled(sched.table)
    sched_card = card(
        pn.FlexBox(_labelled("policies", sched.choices["policies"], width=300),
                   pn.Column(sched.choices["cost_table"], width=200),
                   pn.Column(sched.choices["profile"], width=240),
                   pn.Column(sched.choices["target_model"], width=240),
                   flex_wrap="wrap", gap="0 16px", sizing_mode="stretch_width"),
        pn.FlexBox(*[pn.Column(p, width=190, margin=(0, 4)) for p in sched.controls.values()],
                   flex_wrap="wrap", gap="0 8px", sizing_mode="stretch_width"),
        sched.pane, sched.table,
        title="QoS batch scheduler (MoE-Prism): simulated serving per policy, priced by a cost "
              "table (modeled on a hardware profile, or measured on a CPU)", margin=(4, 4),
        css_classes=["wb-scheduler"])
    diff, deltas = DiffHeatmapView(store, height=360), DeltasView(store)
    answer, progress = answer_view(store), progress_view(store)
    _styled(answer, deltas.pane, *[o for o in progress if isinstance(o, pn.pane.HTML)])
    status = pn.Column(progress, answer, sizing_mode="stretch_width", margin=(4, 4),
                       css_classes=["wb-answer-box"],
                       styles={"border": "1px solid #e5e7eb", "border-radius": "6px"})
    ab = card(pn.FlexBox(pn.Column(deltas.pane, width=560),
                         pn.Column(diff.pane, min_width=420, sizing_mode="stretch_width"),
                         flex_wrap="wrap", sizing_mode="stretch_width"),
              title="A/B: shown run vs pinned baseline", margin=(4, 4))

    def on_baseline(*events: Any) -> None:
        diff.pane.visible = store.baseline is not None

    store.param.watch(on_baseline, "baseline")
    on_baseline()

    # what-if replay of the shown run (pick it in Runs → Open): policies × cache sizes
    rw, rep = replay_widgets(store), ReplayView(store, defer=served)
    _styled(rep.table)
    knob_hint = pn.pane.HTML("<small class='wb-muted'>replay knobs: the shown run's own until "
                             "changed here (they never change the next run)</small>",
                             margin=(0, 10), sizing_mode="stretch_width")
    _styled(knob_hint)
    replay = card(
        pn.FlexBox(_labelled("eviction policies (Belady: the ceiling, always drawn)",
                             rw["evictions"], width=380),
                   _labelled("scope", rw["scope"], width=190),
                   _labelled("cache-size range (slots)", rw["slots"], width=300),
                   _labelled("table at slots", rw["at"], width=120),
                   flex_wrap="wrap", gap="0 16px", sizing_mode="stretch_width"),
        knob_hint,
        pn.FlexBox(*[pn.Column(p, width=190, margin=(0, 4)) for p in rw["knobs"].values()],
                   flex_wrap="wrap", gap="0 8px", sizing_mode="stretch_width"),
        rep.pane, rep.table,
        title="Replay: the shown run under other cache and prefetch policies "
              "(recorded routing, modeled I/O)", margin=(4, 4), css_classes=["wb-replay"])
    compare = CompareView(store)
    _styled(compare.table)
    compare_card = card(compare.choice, compare.table, compare.pane,
                        title="Compare runs: several runs of the workspace side by side",
                        collapsed=True, margin=(4, 4), css_classes=["wb-compare"])
    # under the first screen: filled once the page has rendered (served), so the first screen
    # is built, sent and drawn first (the page load of ``benchmarks/bench_dashboard.py``)
    below = [pn.Row(tokens.pane, recall.pane), ep_card, prism_card, sched_card, ab, replay,
             compare_card]
    later = pn.Column(sizing_mode="stretch_width", margin=0, css_classes=["wb-below"])
    if served:
        def show_below() -> None:
            later.objects = below
            # the views below the first screen are drawn on later ticks, once they are sent
            # (PlotView.first_pending), the slow ones last: the first replay imports torch,
            # the first simulation its compiled kernel
            ticks = TickQueue.of_session()
            first = [v for v in views.values() if getattr(v, "first_pending", False)
                     and v is not rep]
            for view in (*first, rep, sched):
                ticks.add(id(view), view.redraw) if ticks is not None else view.redraw()

        pn.state.onload(show_below)
    else:
        later.objects = below
    main = [status, filters, pn.Row(heat.pane, hit.pane), pn.Row(lat.pane, tl.pane), later]
    views = {"heatmap": heat, "hit_rate": hit, "latency": lat, "timeline": tl,
             "heatmap_diff": diff, "deltas": deltas, "replay": rep, "tokens": tokens,
             "hot_recall": recall, "compare": compare, "ep": ep, "ep_timeline": ep_tl,
             "realb": realb, "subexperts": subs, "prism_points": points, "scheduler": sched}

    # served: runs on the session's event loop; in a notebook: on the kernel's loop
    # the store's new steps are read only when the session's redraws have rested (TickQueue):
    # under load frames are dropped, and clicks are read in the idle time
    ticks = TickQueue.of_session()
    poll_now = store.poll if ticks is None else lambda: store.poll(tail=ticks.ready())
    poll = pn.state.add_periodic_callback(poll_now, period=poll_ms) if poll_ms else None
    if ticks is not None:
        # redraws rest only while the shown run streams (TickQueue): new data keeps coming
        ticks.rest_while = lambda: store.live or store.streaming
        # the run's end is shown on the next tick of the loop, not up to a period later: the
        # run's thread schedules a poll (add_next_tick_callback: Bokeh's thread-safe entry)
        from panel.io.state import set_curdoc

        doc = ticks.doc

        def poll_in_session() -> None:
            with set_curdoc(doc):  # Panel sends the changes at once, as in its own callbacks
                poll_now()

        store.wake = lambda: doc.add_next_tick_callback(poll_in_session)

    if template:
        # Bootstrap, not Fast: the Fast design fetches a Google font (no third-party requests)
        app = pn.template.BootstrapTemplate(
            title=TITLE, sidebar=sidebar, main=main, sidebar_width=SIDEBAR_W,
            header_background="#2F4F6F")
    else:
        app = pn.Row(pn.Column(*sidebar, width=SIDEBAR_W), pn.Column(*main))
    app._wb_store, app._wb_views, app._wb_poll = store, views, poll  # tests and notebooks
    app._wb_widgets = {"input": inp, "runs": runs, "models": models, "error": error,
                       "progress": progress,
                       "replay": rw, "prism": prism_knobs._wb_widgets}
    return app


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def serve(address: str = "127.0.0.1", port: int = 0, show: bool = False, **kwargs: Any):
    """Serve the dashboard with ``pn.serve`` on ``address`` (loopback by default) and ``port``
    (0: a free one). Blocks until interrupted (pass ``threaded=True`` to get the server thread
    back instead); extra keyword arguments go to ``pn.serve``."""
    import os

    # spinning OpenMP waits starve the event loop on a busy CPU (effective before torch loads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    port = port or _free_port(address)
    origins = kwargs.pop("websocket_origin",
                         sorted({f"{address}:{port}", f"localhost:{port}", f"127.0.0.1:{port}"}))
    # at /dashboard, the address `panel serve apps/dashboard.py` gives (the README's); / redirects there
    print(f"workbench dashboard: http://{address}:{port}/dashboard", flush=True)
    kwargs.setdefault("warm", True)  # the first page opened does not wait for the imports
    return pn.serve({"dashboard": build_app}, address=address, port=port, show=show,
                    websocket_origin=origins, title=TITLE, **kwargs)
