"""The ``workbench`` command.

``workbench run``   one request on the offloaded runtime: answer, offloading summary, run store.
``workbench info``  architecture, MoE layout and memory plans of a model under the given knobs.
``workbench sweep``  a knob grid × inputs on Dask distributed, one store per point + a summary.
``workbench dashboard`` the Panel dashboard on 127.0.0.1.
``workbench knobs`` every knob with its default, bounds and doc.
``workbench export-trace`` a run store's routing as a .jsonl, .npy or .wbtrace trace file.

Long commands (refactor, calibrate, calibrate-macs, sweep; the trainer too) draw progress bars
with an ETA on stderr when it is a terminal (``--progress`` forces them, ``--no-progress`` hides
them).

Bad input (unknown knob, bad value, missing image or model, empty or too long prompt, an existing
store without ``--overwrite``) prints one ``workbench: error: …`` line and exits with status 2;
nothing is written and no existing store is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with errors as every other error of the CLI: one ``… error: …`` line (no usage
    block; ``--help`` has it), and with ``--json`` one JSON error object on stdout too."""

    json_errors = False  # set from the command line before parsing

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        if _Parser.json_errors:
            print(json.dumps({"error": {"type": "UsageError", "message": message,
                                        "exit_code": EXIT_USAGE}}))
        raise SystemExit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    from workbench._version import __version__

    p = _Parser(
        prog="workbench", description="See and steer expert offloading of VL-MoE models.")
    p.add_argument("--version", action="version", version=f"workbench {__version__}")
    p.add_argument("--debug", action="store_true",
                   help="show the Python traceback of an error instead of one line (anywhere "
                        "on the command line)")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", metavar="DIR",
                        help="local Hugging Face checkpoint directory (default: the embedded "
                             "Qwen3-VL-MoE model in data/)")
        sp.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                        help="set a knob (repeatable); `workbench knobs` lists them")
        sp.add_argument("--json", action="store_true", help="print one JSON object")

    def progress_flag(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bars with an ETA on stderr (default: only when stderr "
                             "is a terminal; --no-progress never)")

    r = sub.add_parser("run", help="serve one request (or a batch) with experts offloaded")
    common(r)
    r.add_argument("--image", dest="images", action="append", default=[], metavar="PATH",
                   help="input image (repeatable)")
    r.add_argument("--prompt", help="the question or instruction (one request)")
    r.add_argument("--input", dest="inputs", action="append", default=[],
                   metavar="'IMAGE|PROMPT' or 'PROMPT'",
                   help="a request of a batch run together (repeatable; instead of --prompt)")
    r.add_argument("--batch", type=int, metavar="N",
                   help="run a batch of N generated requests together (instead of --prompt; "
                        "see --batch-source, --batch-mix)")
    r.add_argument("--batch-source", choices=("heldout", "demo"), default=None,
                   help="--batch from the held-out generated scenes (default) or the demo "
                        "requests")
    r.add_argument("--batch-mix", choices=("mixed", "image", "text"), default=None,
                   help="--batch: the split's mix of image and text-only requests (default; "
                        "text-only requests for a text-only --model), image requests only, or "
                        "text-only requests only")
    r.add_argument("--batch-seed", type=int, metavar="S",
                   help="--batch: seed of the generated split (default: the held-out seed)")
    r.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="tokens to generate at most (the max_new_tokens knob)")
    r.add_argument("--store", metavar="PATH",
                   help="zarr run store to write (default: a new folder under runs/)")
    r.add_argument("--overwrite", action="store_true", help="replace an existing store")
    r.add_argument("--no-record", action="store_true", help="do not write a run store")

    i = sub.add_parser("info", help="architecture, MoE layout and memory plan")
    common(i)

    s = sub.add_parser("sweep", help="run a knob grid × inputs on Dask distributed")
    common(s)
    s.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2,…",
                   help="a knob and its values (repeatable; the grid is their product)")
    s.add_argument("--input", dest="inputs", action="append", default=[],
                   metavar="'IMAGE|PROMPT' or 'PROMPT'",
                   help="an input (repeatable; default: the demo image request and the "
                        "text-only one with the longest answers)")
    s.add_argument("--out", required=True, metavar="PATH", help="sweep folder")
    s.add_argument("--scheduler", metavar="ADDRESS",
                   help="existing Dask scheduler, tcp://HOST:PORT (must answer within 5 s; default: a "
                        "LocalCluster on 127.0.0.1)")
    s.add_argument("--batch", type=int, default=1, metavar="N",
                   help="run each input in a batch of N: with N − 1 generated held-out requests "
                        "(expert-parallel load needs a batch; default 1)")
    s.add_argument("--batch-mix", choices=("mixed", "image", "text"), default=None,
                   help="--batch: the generated requests' mix (default: the held-out split's; "
                        "text-only for a text-only --model)")
    s.add_argument("--workers", type=int, default=None, metavar="N",
                   help="LocalCluster worker processes (default 2; not with --scheduler)")
    progress_flag(s)

    d = sub.add_parser("dashboard", help="serve the Panel dashboard (127.0.0.1 by default)")
    d.add_argument("--address", default="127.0.0.1",
                   help="interface to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    d.add_argument("--port", type=int, default=5006, help="port (default 5006; 0 = any free)")
    d.add_argument("--show", action="store_true", help="open a browser tab")

    rp = sub.add_parser("replay", help="replay a routing trace under cache/prefetch knobs")
    rp.add_argument("trace", metavar="TRACE",
                    help="run store, .jsonl, .npy or .wbtrace file (see docs/traces.md)")
    rp.add_argument("--format", default="auto",
                    help="trace format: auto, store, jsonl, npy, plain (default auto)")
    rp.add_argument("--scope", default="global",
                    help="global: one slot pool for all layers; per-layer: an equal share each")
    rp.add_argument("--num-experts", type=int, metavar="N",
                    help="experts per layer (jsonl/npy; default: largest id + 1)")
    rp.add_argument("--prefill-tokens", type=int, default=0, metavar="N",
                    help="npy: the first N tokens form one prefill step")
    rp.add_argument("--engine", default="auto", help="auto, fast (numba) or python")
    rp.add_argument("--no-belady", dest="belady", action="store_false",
                    help="skip the Belady bound (a second replay: about half the time)")
    rp.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                    help="set a knob (repeatable); see `workbench knobs`")
    rp.add_argument("--json", action="store_true", help="print one JSON object")

    c = sub.add_parser("calibrate", help="train the lookahead predictor from recorded runs")
    c.add_argument("--model", metavar="DIR",
                   help="local Hugging Face checkpoint directory (default: the embedded model)")
    c.add_argument("--inputs", nargs="+", default=[], metavar="FILE",
                   help="images (asked --prompt) or JSON lists of {image, prompt} "
                        "(default: --requests generated scenes)")
    c.add_argument("--prompt", default=None,
                   help="question asked about each --inputs image (default: what shape is "
                        "red?)")
    c.add_argument("--out", required=True, metavar="PATH",
                   help="directory for predictor.safetensors + predictor.json")
    c.add_argument("--overwrite", action="store_true", help="replace an existing PATH")
    c.add_argument("--steps", type=int, default=300, metavar="N",
                   help="training steps (full-batch Adam; default 300)")
    c.add_argument("--requests", type=int, default=None, metavar="N",
                   help="generated scenes when no --inputs (default 48)")
    c.add_argument("--max-new-tokens", type=int, default=4, metavar="N",
                   help="decode steps recorded per request (default 4)")
    c.add_argument("--seed", type=int, default=0, help="seed of scenes and training (default 0)")
    c.add_argument("--window", type=int, default=5, metavar="W", help="W (default 5)")
    c.add_argument("--decay", type=float, default=0.8, metavar="GAMMA", help="γ (default 0.8)")
    c.add_argument("--no-visual-summary", action="store_true",
                   help="train the ablation without h^(v)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    progress_flag(c)

    m = sub.add_parser("calibrate-macs",
                       help="MACS expert classes and centroids from calibration requests")
    m.add_argument("--model", metavar="DIR",
                   help="local Hugging Face checkpoint directory (default: the embedded model)")
    m.add_argument("--out", metavar="PATH",
                   help="folder for macs.safetensors + macs.json (default: the workspace's "
                        "macs/<config hash>, where runs look first)")
    m.add_argument("--overwrite", action="store_true", help="replace an existing calibration")
    m.add_argument("--requests", type=int, default=64, metavar="N",
                   help="generated calibration requests, half text-only, half image (default 64)")
    m.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed of the calibration requests (default: one disjoint from the "
                        "held-out and demo seeds)")
    m.add_argument("--threshold", type=float, default=0.1, metavar="T",
                   help="|Δ_j| from which an expert is visual/text (default 0.1, the paper's)")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    progress_flag(m)

    f = sub.add_parser("refactor",
                       help="MoE-Prism: split every expert into sub-experts (profile, "
                            "partition, proxy gate) from calibration requests")
    f.add_argument("--model", metavar="DIR",
                   help="local Hugging Face checkpoint directory (default: the embedded model)")
    f.add_argument("--out", metavar="PATH",
                   help="folder for prism.safetensors + prism.json (default: the workspace's "
                        "prism/<config hash>)")
    f.add_argument("--overwrite", action="store_true", help="replace an existing refactoring")
    f.add_argument("--requests", type=int, default=None, metavar="N",
                   help="generated calibration requests, half text-only (all text-only for a "
                        "text-only model; default 64)")
    f.add_argument("--input", dest="inputs", action="append", default=[],
                   metavar="'IMAGE|PROMPT' or 'PROMPT'",
                   help="a calibration request of your own (repeatable; instead of generated "
                        "ones): text prompts for a text MoE")
    f.add_argument("--input-file", metavar="FILE",
                   help="calibration requests of your own, one per line as --input (UTF-8; "
                        "blank lines and lines starting with # skipped)")
    f.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed of the calibration requests (default: one of their own)")
    f.add_argument("--subexperts", type=int, default=4, metavar="N",
                   help="sub-experts per expert (default 4, the paper's); must divide the "
                        "expert's neurons")
    f.add_argument("--deactivated", type=int, default=None, metavar="K",
                   help="sub-experts the objective drops per token (default N // 2)")
    f.add_argument("--iterations", type=int, default=100_000, metavar="I",
                   help="annealing iterations per expert (default 100 000, the paper's)")
    f.add_argument("--max-tokens", type=int, default=128, metavar="B",
                   help="calibration tokens kept per expert (default 128)")
    f.add_argument("--json", action="store_true", help="print one JSON object")
    progress_flag(f)

    x = sub.add_parser("export-trace",
                       help="write a run store's routing as a trace file: .jsonl, .npy or "
                            ".wbtrace (see docs/traces.md)")
    x.add_argument("source", metavar="STORE",
                   help="run store (or a trace file in another format: .jsonl, .npy, .wbtrace)")
    x.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    x.add_argument("--format", default=None,
                   help="jsonl, npy or wbtrace (default: from --out's suffix, which must agree)")
    x.add_argument("--overwrite", action="store_true", help="replace an existing FILE")
    x.add_argument("--json", action="store_true", help="print one JSON object")

    k = sub.add_parser("knobs", help="list every knob with its default, bounds and doc")
    k.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; bad input prints one ``workbench: error: …`` line and returns 2 (an
    unexpected failure prints one line too and returns 1); ``--debug`` re-raises instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line, before or after the command
    _Parser.json_errors = "--json" in argv
    args = _parser().parse_args([a for a in argv if a != "--debug"])
    args.debug = debug
    from workbench.errors import WorkbenchError

    try:
        _check_option_pairs(args)
        return {"run": _run, "info": _info, "knobs": _knobs, "sweep": _sweep,
                "dashboard": _dashboard, "replay": _replay, "calibrate": _calibrate,
                "calibrate-macs": _calibrate_macs, "refactor": _refactor,
                "export-trace": _export_trace}[args.command](args)
    except KeyboardInterrupt:
        print("workbench: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`workbench … | head`): not an error
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 0
    except Exception as e:
        if args.debug:
            raise
        if isinstance(e, WorkbenchError):
            return _fail(args, f"{e}", type(e).__name__, EXIT_USAGE)
        if isinstance(e, OSError):  # the file system said no: the user's to fix
            where = f" ({e.filename})" if e.filename else ""
            return _fail(args, f"{e.strerror or e}{where}", "OSError", EXIT_USAGE)
        if isinstance(e, MemoryError):
            return _fail(args, "out of memory; use a smaller input or a machine with more memory",
                         "MemoryError", EXIT_USAGE)
        return _fail(args, f"{type(e).__name__}: {e} (rerun with --debug for the traceback, and "
                           f"please report it)", "InternalError", 1, internal=True)


#: options that only mean something with another: (command, option, its attribute, whether it
#: acts given the other options, what it needs — the message says it)
_NEEDS = (
    ("run", "--batch-source", "batch_source", lambda a: a.batch is not None,
     "it only applies with --batch N; drop it or use --batch"),
    ("run", "--batch-mix", "batch_mix", lambda a: a.batch is not None,
     "it only applies with --batch N; drop it or use --batch"),
    ("run", "--batch-seed", "batch_seed", lambda a: a.batch is not None,
     "it only applies with --batch N; drop it or use --batch"),
    ("sweep", "--batch-mix", "batch_mix", lambda a: a.batch != 1,
     "it only applies with --batch N for N > 1 (the generated requests it mixes)"),
    ("sweep", "--workers", "workers", lambda a: a.scheduler is None,
     "it only applies without --scheduler (that scheduler's workers are its own)"),
    ("refactor", "--requests", "requests", lambda a: not (a.inputs or a.input_file),
     "it only applies to generated requests, not with --input/--input-file"),
    ("refactor", "--seed", "seed", lambda a: not (a.inputs or a.input_file),
     "it only applies to generated requests, not with --input/--input-file"),
    ("calibrate", "--prompt", "prompt", lambda a: bool(a.inputs),
     "it only applies with --inputs (the question asked about each image)"),
    ("calibrate", "--requests", "requests", lambda a: not a.inputs,
     "it only applies to generated scenes, not with --inputs"),
)


def _check_option_pairs(args) -> None:
    """Refuse an option given where it does nothing (e.g. ``run --batch-mix`` with
    ``--prompt``): silently ignoring it would report a run that is not the one asked for. The
    message names the option it needs. Defaults are then filled in."""
    from workbench.errors import InputError

    model = getattr(args, "model", None)
    if model is not None and model.strip() == "":  # "" was silently the default model
        raise InputError(f"--model {model!r} is blank; give a model folder, or leave --model out "
                         f"for the embedded model")
    for command, flag, attr, acts, needs in _NEEDS:
        if args.command == command and getattr(args, attr) is not None and not acts(args):
            raise InputError(f"{flag} {getattr(args, attr)!r} does nothing here: {needs}")
    for command, attr, default in (("run", "batch_source", "heldout"),
                                   ("refactor", "requests", 64),
                                   ("calibrate", "prompt", "what shape is red?"),
                                   ("calibrate", "requests", 48)):
        if args.command == command and getattr(args, attr) is None:
            setattr(args, attr, default)


def _fail(args, message: str, kind: str, code: int, internal: bool = False) -> int:
    """Report an error: one ``workbench: error: …`` line on stderr, and with ``--json`` also one
    JSON object ``{"error": {"type", "message", "exit_code"}}`` on stdout, so a script that reads
    the JSON output gets its errors in the same form. Returns ``code``."""
    print(f"workbench: {'internal error' if internal else 'error'}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": {"type": kind, "message": message, "exit_code": code}}))
    return code


def _export_trace(args) -> int:
    from workbench.traces import export_trace

    res = export_trace(args.source, args.out, format=args.format, overwrite=args.overwrite)
    if args.json:
        print(json.dumps(res))
        return 0
    back = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in res["read_with"].items())
    print(f"wrote {res['path']}: {res['format']} trace of {res['tokens']} tokens × "
          f"{res['layers']} layers × top-{res['top_k']} ({res['steps']} steps, "
          f"{res['requests']} request{'s' if res['requests'] != 1 else ''}), "
          f"{res['bytes']:,} bytes; not carried: {', '.join(res['dropped']) or 'nothing'}; "
          f"replay it with {back}")
    return 0


def _progress_wanted(args) -> bool:
    from workbench.progress import wanted

    return wanted(args.progress)


def _bars(args):
    """The progress bars of a long command (:mod:`workbench.progress`): ``--progress`` /
    ``--no-progress``, else drawn only when stderr is a terminal; never on stdout."""
    from workbench.progress import Bars

    return Bars(_progress_wanted(args), prefix=f"{args.command}: ")


@contextlib.contextmanager
def _claimed_out(args, default: "Path | None", config: str, holds: str,
                 files: tuple[str, ...] = ()):
    """The output folder (``--out``, else ``default``) of a command that writes one, checked
    before any work (the shared output-folder check: blank, dangling or looping links, a file
    in the way, ``config`` already there without ``--overwrite``, nowhere writable) and then
    held under its one-writer lock for the whole command: a second writer of it is refused at
    once (:class:`StoreBusyError`) instead of both reporting success over each other's files.
    Yields None when there is no ``--out`` and no ``default`` yet (the model names it)."""
    from workbench.telemetry.destination import check_output_folder, writer_lock

    what = "--out" if args.out is not None else "output folder"
    path = args.out if args.out is not None else default
    if path is None:
        yield None
        return
    out = check_output_folder(path, what, config=config, overwrite=args.overwrite, holds=holds,
                              files=files)
    with writer_lock(out, f"{holds} folder"):
        # checked again under the lock: another writer may have finished in between
        yield check_output_folder(out, what, config=config, overwrite=args.overwrite,
                                  holds=holds, files=files)


def _refactor(args) -> int:
    from workbench.errors import InputError
    from workbench.prism import refactor as R

    for name, v, lo, hi in (("--requests", args.requests, 1, 4096),
                            ("--subexperts", args.subexperts, 1, 1024),
                            ("--iterations", args.iterations, 0, 10**8),
                            ("--max-tokens", args.max_tokens, 1, 65536)):
        if not lo <= v <= hi:
            raise InputError(f"{name} must be from {lo} to {hi}, not {v}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise InputError(f"--seed must be from 0 to 2**63 − 1, not {args.seed}")
    reqs = _own_requests(args.inputs, args.input_file)  # bad input costs no model load
    holds = "MoE-Prism refactoring"
    from workbench.models.loading import load
    from workbench.options import get_options

    with contextlib.ExitStack() as stack:
        # --out is claimed before the model loads (a bad or busy one costs nothing), the
        # default folder, named by the model, right after
        own = (R.CONFIG, R.WEIGHTS)
        out = stack.enter_context(_claimed_out(args, None, R.CONFIG, holds, own))
        lm = load(Path(args.model) if args.model else None, device="cpu")
        if out is None:
            out = stack.enter_context(_claimed_out(
                args, Path(get_options()["workspace"]) / "prism" / str(lm.config_hash),
                R.CONFIG, holds, own))
        return _refactor_into(args, lm, reqs, out)


def _refactor_into(args, lm, reqs: list, out: Path) -> int:
    import numpy as np

    from workbench.prism import refactor as R
    from workbench.prism.partition import check_problem
    from workbench.prism.profile import neuron_layout

    I = neuron_layout(lm.layout.blocks[0])[0]
    check_problem(np.zeros((1, I)), args.subexperts, args.deactivated)  # N divides I, K in range
    source = "given"
    if not reqs:
        reqs = R.calibration_requests(args.requests, R.CALIBRATION_SEED if args.seed is None
                                      else args.seed, text_only=not lm.is_vision)
        source = "generated" + ("" if lm.is_vision else ", text-only")
    with _bars(args) as bars:
        ref = R.refactor(lm, reqs, subexperts=args.subexperts, deactivated=args.deactivated,
                         r=min(4, I // args.subexperts), iterations=args.iterations,
                         max_tokens=args.max_tokens, progress=bars.callback)
    R.save(ref, out, overwrite=args.overwrite)
    s = ref.summary()
    if args.json:
        print(json.dumps({"out": str(out), **s, "profile_s": ref.meta["profile_s"],
                          "anneal_s": ref.meta["anneal_s"],
                          "calibration": {"requests": len(reqs), "source": source}}))
    else:
        o = s["objective"]
        print(f"MoE-Prism refactoring of {lm.model_id} written to {out}: {s['experts']} experts "
              f"× {args.subexperts} sub-experts of {I // args.subexperts} neurons; objective "
              f"(activation lost dropping {ref.meta['deactivated']} per token, Σ over experts) "
              f"annealed {o['annealed']:.1f} vs greedy {o['greedy']:.1f}, random "
              f"{o['random']:.1f}, contiguous {o['contiguous']:.1f}; calibrated on "
              f"{len(reqs)} {source} requests; profile {ref.meta['profile_s']:.1f} s, "
              f"annealing {ref.meta['anneal_s']:.1f} s")
    return 0


#: at most this many requests and bytes in an --input-file
MAX_INPUT_LINES, MAX_INPUT_BYTES = 4096, 16 << 20


def _own_requests(inputs: list[str], input_file: str | None) -> list:
    """The requests of ``--input`` (each ``'IMAGE|PROMPT'`` or ``'PROMPT'``) and of
    ``--input-file`` (one per line, UTF-8 with or without a BOM; blank lines and ``#``
    comments skipped), in that order, each prompt and image checked (header only) with the
    error naming its line; [] when neither is given. Bounded: :data:`MAX_INPUT_LINES`
    requests, :data:`MAX_INPUT_BYTES` of file, checked before it is read."""
    from workbench.analysis.sweep import SweepInput
    from workbench.errors import InputError
    from workbench.fileio import read_text
    from workbench.models.inputs import Request, check_prompt, probe_image

    texts = [("--input", t) for t in inputs]
    if input_file is not None:
        name = f"--input-file {input_file!r}"
        # a FIFO or a device never ends, a sparse file is refused by its size before it is read
        text = read_text(input_file, MAX_INPUT_BYTES, name, empty_ok=True)
        # lines as an editor counts them: \n (and \r\n), not every separator str.splitlines knows
        lines = [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1)]
        mine = [(f"{name} line {n}", line) for n, line in lines
                if line.strip() and not line.lstrip().startswith("#")]
        if not mine:
            raise InputError(f"{name} has no requests (only blank lines and # comments)")
        texts += mine
    if len(texts) > MAX_INPUT_LINES:
        raise InputError(f"{len(texts)} calibration requests given; at most "
                         f"{MAX_INPUT_LINES} are taken")
    out = []
    for where, text in texts:
        try:
            i = SweepInput.parse(text)
            check_prompt(i.prompt)
            for img in i.images:
                probe_image(img)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        out.append(Request(i.prompt, list(i.images)))
    return out


def _calibrate_macs(args) -> int:
    from workbench.errors import InputError
    from workbench.macs.calibration import (CALIBRATION_SEED, CONFIG, WEIGHTS, calibrate,
                                            calibration_requests, save, workspace_path)

    if not 2 <= args.requests <= 4096:
        raise InputError(f"--requests must be from 2 to 4096, not {args.requests}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise InputError(f"--seed must be from 0 to 2**63 − 1, not {args.seed}")
    if not 0.0 < args.threshold < 1.0:
        raise InputError(f"--threshold must be in (0, 1), not {args.threshold}")
    from workbench.models.loading import load

    holds = "MACS calibration"
    with contextlib.ExitStack() as stack:
        # --out claimed before the model loads, the default folder (the model's) after
        out = stack.enter_context(_claimed_out(args, None, CONFIG, holds, (CONFIG, WEIGHTS)))
        lm = load(Path(args.model) if args.model else None, device="cpu")
        if not lm.is_vision:
            raise InputError(f"MACS calibration classes experts by their visual and text "
                             f"tokens; model {lm.model_id!r} is text-only (it needs a "
                             f"vision-language checkpoint)")
        if out is None:
            out = stack.enter_context(_claimed_out(args, workspace_path(lm.config_hash),
                                                   CONFIG, holds, (CONFIG, WEIGHTS)))
        reqs = calibration_requests(args.requests, CALIBRATION_SEED if args.seed is None
                                    else args.seed)
        with _bars(args) as bars:
            cal = calibrate(lm, reqs, args.threshold, progress=bars.callback)
        save(cal, out, overwrite=args.overwrite)
    summary = {"out": str(out), **cal.summary()}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"MACS calibration of {lm.model_id} written to {out}: "
              f"{summary['visual_experts']} visual, {summary['text_experts']} text, "
              f"{summary['shared_experts']} shared experts over {summary['layers']} layers "
              f"(|Δ| ≥ {args.threshold}; {summary['visual_tokens']} visual and "
              f"{summary['text_tokens']} text tokens of {summary['requests']} requests)")
    return 0


def _calibrate(args) -> int:
    _calibrate_flags(args)
    out = _calibrate_out(args)
    from workbench.telemetry.destination import writer_lock

    with writer_lock(out, "predictor folder"):
        # checked again under the lock: another writer may have finished in between
        return _calibrate_into(args, _calibrate_out(args))


def _calibrate_out(args) -> Path:
    """``--out`` of ``workbench calibrate``, checked: the shared output-folder check (written
    through a symlink, as run stores are), then what ``--overwrite`` may replace."""
    from workbench.errors import InputError, StoreExistsError
    from workbench.predictor.model import CONFIG, WEIGHTS
    from workbench.telemetry.destination import check_output_folder

    out = check_output_folder(args.out, "--out")
    fresh = not out.exists() or (out.is_dir() and not any(out.iterdir()))  # empty = absent
    if not fresh and not args.overwrite:
        raise StoreExistsError(f"--out {str(out)!r} already exists; pass --overwrite to replace "
                               f"it, or choose another path")
    if not fresh:  # --overwrite replaces a calibrated predictor and nothing else
        extra = (sorted(p.name for p in out.iterdir() if p.name not in (CONFIG, WEIGHTS))
                 if out.is_dir() else [out.name])
        if extra:
            raise InputError(f"--out {str(out)!r} is not a calibrated predictor folder (it "
                             f"holds {', '.join(extra[:5])}); --overwrite only replaces "
                             f"{CONFIG} + {WEIGHTS} — refusing to delete it")
    return out


def _calibrate_flags(args) -> None:
    from workbench.errors import InputError
    from workbench.predictor.calibrate import (MAX_CALIB_REQUESTS, MAX_CALIB_STEPS,
                                               MAX_RECORDED_TOKENS)
    from workbench.predictor.model import MAX_SIZE

    # the bounds a run takes a predictor with (predictor.json: window ≤ MAX_SIZE), and what
    # calibration can hold in memory (every request's routing is recorded, then trained on)
    for flag, value, ok, allowed in (
            ("--steps", args.steps, 1 <= args.steps <= MAX_CALIB_STEPS,
             f"from 1 to {MAX_CALIB_STEPS:,}"),
            ("--requests", args.requests, 2 <= args.requests <= MAX_CALIB_REQUESTS,
             f"from 2 to {MAX_CALIB_REQUESTS:,}"),
            ("--max-new-tokens", args.max_new_tokens,
             1 <= args.max_new_tokens <= MAX_RECORDED_TOKENS, f"from 1 to {MAX_RECORDED_TOKENS}"),
            ("--window", args.window, 1 <= args.window <= MAX_SIZE, f"from 1 to {MAX_SIZE:,}"),
            ("--seed", args.seed, 0 <= args.seed < 2**32, "from 0 to 2**32 − 1"),
            ("--decay", args.decay, 0.0 < args.decay <= 1.0, "in (0, 1]")):
        if not ok:
            raise InputError(f"{flag} must be {allowed}, not {value}")


def _calibrate_into(args, out: Path) -> int:
    from workbench.errors import InputError
    from workbench.predictor.calibrate import (calibrate, format_report, parse_inputs,
                                               scene_requests)

    requests = (parse_inputs(args.inputs, args.prompt) if args.inputs
                else None)
    from workbench.models.loading import load
    from workbench.predictor.model import save

    lm = load(Path(args.model) if args.model else None, device="cpu")
    if not lm.is_vision:
        raise InputError(f"the lookahead predictor (VisMMOE) is calibrated on image requests "
                         f"and the visual tokens' summary; model {lm.model_id!r} is text-only "
                         f"(it needs a vision-language checkpoint)")
    if requests is None:
        requests = scene_requests(args.seed, args.requests)

    with _bars(args) as bars:
        pred, report = calibrate(lm, requests, steps=args.steps, seed=args.seed,
                                 window=args.window, decay=args.decay,
                                 use_visual=not args.no_visual_summary,
                                 max_new_tokens=args.max_new_tokens, progress=bars.callback)
    # saved aside, then put in place: a failure leaves the old predictor as it was
    import secrets
    import shutil

    stage = out.with_name(f".{out.name}.staging-{secrets.token_hex(4)}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save(pred, stage, report)
        if out.exists() and not any(out.iterdir()):
            out.rmdir()
        if out.exists():
            old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
            os.rename(out, old)
            os.rename(stage, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    report["out"] = str(out)
    if args.json:
        print(json.dumps(report, default=float))
    else:
        print(format_report(report))
        print(f"saved: {out}")
    return 0


def _knobs_from(args) -> "object":
    from workbench.errors import KnobError
    from workbench.knobs import Knobs

    knobs = Knobs().set_from_strings(args.sets)
    if getattr(args, "max_new_tokens", None) is not None:
        if any(a.split("=", 1)[0].strip() == "max_new_tokens" for a in args.sets):
            raise KnobError("max_new_tokens is given twice (--max-new-tokens and --set "
                            "max_new_tokens=…); give it once")
        knobs.set(max_new_tokens=args.max_new_tokens)
    if args.command in ("run", "info", "sweep"):  # live: refused before any model loads
        from workbench.knobs import ModelShape

        knobs.check(ModelShape.unknown(), live=True)
    return knobs


def _runtime(args, knobs):
    from workbench.runtime.runtime import Runtime

    return Runtime(Path(args.model) if args.model else None, knobs=knobs)


def _run(args) -> int:
    from workbench.errors import InputError
    from workbench.models.inputs import Request, check_batch_pixels, check_prompt
    from workbench.telemetry.store import check_store_path

    knobs = _knobs_from(args)
    # cheap checks first, so that bad input costs no model load and touches nothing
    requests = _run_requests(args)
    for r in requests or [None]:
        check_prompt(args.prompt if r is None else r.prompt)
    # headers only, and what the batch's images cost together; the run decodes them (and names
    # a file that fails)
    check_batch_pixels(requests or [Request(args.prompt, list(args.images))])
    images = list(args.images)
    if args.no_record and (args.store is not None or args.overwrite):
        raise InputError("--no-record writes no store: drop --store/--overwrite, or drop "
                         "--no-record")
    store = None
    if args.store is not None:
        # before the model loads: a store that cannot be written costs nothing and touches nothing
        store = check_store_path(args.store, args.overwrite)
    rt = _runtime(args, knobs)
    streamed = {"n": 0}

    def on_token(_tok: int, text: str) -> None:
        if args.json:
            return
        if streamed["n"] == 0 and "started" not in streamed:  # the label only once there is
            streamed["started"] = True                          # an answer (an error prints
            print("answer: ", end="", flush=True)               # alone on its line)
        new = text[streamed["n"]:]
        streamed["n"] = len(text)
        print(new, end="", flush=True)

    try:
        # a batch's answers come together at the end (one stream would interleave them)
        res = rt.run(requests if requests else args.prompt, images=images, store=store,
                     overwrite=args.overwrite, record=not args.no_record,
                     on_token=None if requests else on_token)
    except BaseException:
        if "started" in streamed:  # end the answer line: the error gets a line of its own
            print(flush=True)
        raise
    ep = _run_ep(res, knobs)
    if args.json:
        print(json.dumps({**res.to_json(), **({"ep": ep} if ep is not None else {})}))
    else:
        if not requests:
            if "started" not in streamed:
                print("answer: ", end="")
            print()
        print("\n".join(res.summary().splitlines()[1:]))
        if ep is not None and "note" in ep:
            print(f"EP ({ep['ranks']} ranks): {ep['note']}")
        elif ep is not None:
            for a, b in _ep_rows(ep, lambda v, spec: "n/a" if v is None else format(v, spec),
                                 lambda v: "n/a" if v is None else f"{v * 1e3:.2f} ms"):
                print(f"{a}: {b}")
    return 0


def _run_requests(args) -> list | None:
    """The batch of ``workbench run`` (``--batch`` or ``--input``), or None for one
    ``--prompt`` request; exactly one of the three is given."""
    from workbench.errors import InputError

    given = [f for f, v in (("--prompt", args.prompt is not None), ("--input", args.inputs),
                            ("--batch", args.batch is not None)) if v]
    if len(given) != 1:
        raise InputError("give one of --prompt (one request), --input (repeatable: a batch) "
                         "or --batch N (generated requests)"
                         + (f", not {' and '.join(given)}" if given else ""))
    if args.images and args.prompt is None:
        raise InputError("--image goes with --prompt; a --input request names its images "
                         "itself ('IMAGE|PROMPT')")
    if args.prompt is not None:
        return None
    from workbench.models.inputs import Request

    if args.inputs:
        from workbench.analysis.sweep import SweepInput

        return [Request(i.prompt, list(i.images)) for i in map(SweepInput.parse, args.inputs)]
    from workbench.models.batches import batch

    from workbench.models.loading import takes_images

    mix = args.batch_mix or ("mixed" if takes_images(args.model) else "text")
    return batch(args.batch, source=args.batch_source, mix=mix, seed=args.batch_seed)


def _run_ep(res, knobs) -> dict | None:
    """The run's expert-parallel load (``ep_ranks`` > 1, virtual ranks): summed as its store
    was written (``res.ep``), else read from its store (EPLB's placement); a note instead
    without one (``--no-record``)."""
    if knobs.ep_ranks <= 1:
        return None
    if not res.store:
        return {"ranks": knobs.ep_ranks, "note": "not computed: --no-record keeps no routing "
                                                 "to attribute to ranks"}
    if getattr(res, "ep", None) is not None:  # summed as the store was written
        return res.ep
    from workbench.analysis import open_run  # ds.moe registered
    from workbench.replay.ep import EP_ARRAYS

    # (EPLB's placement, or a stream that stopped: from the store, the arrays the summary
    # reads only: ≈ 6 ms less a run than opening all, bench_dispatch.py --ep-summary)
    return open_run(res.store, variables=EP_ARRAYS).moe.ep_summary()


def _replay(args) -> int:
    from workbench.errors import InputError
    from workbench.knobs import Knobs
    from workbench.replay import SCOPES, replay_trace
    from workbench.traces import FORMATS, load_trace

    if args.scope not in SCOPES:
        raise InputError(f"--scope must be one of {', '.join(SCOPES)}, not {args.scope!r}")
    if args.format not in FORMATS:
        raise InputError(f"--format must be one of {', '.join(FORMATS)}, not {args.format!r}")
    opts = {}  # load_trace refuses an option the trace's format does not take
    if args.num_experts is not None:
        opts["num_experts"] = args.num_experts
    if args.prefill_tokens:
        opts["prefill_tokens"] = args.prefill_tokens
    trace = load_trace(Path(args.trace), format=args.format, **opts)
    from workbench.knobs import aliases
    from workbench.replay import replay_knob_names

    old_names = aliases()
    given = [old_names.get(n, n) for n in (a.split("=", 1)[0].strip() for a in args.sets)]
    known = set(Knobs().names())  # an unknown name gets its own error (with a suggestion)
    cannot = sorted({n for n in given if n in known} - replay_knob_names())
    if cannot:
        raise InputError(f"a replay cannot change {', '.join(cannot)}: "
                         f"{'it is a live-run knob' if len(cannot) == 1 else 'live-run knobs'} "
                         f"(what or where the model computes), and the trace holds the routing "
                         f"it recorded; replay takes the cache, prefetch and cost-model knobs "
                         f"and the policies' own (workbench knobs)")
    base = Knobs.from_attrs(trace.attrs) if trace.attrs.get("source") == "store" else Knobs()
    knobs = base.set_from_strings(args.sets)
    res = replay_trace(trace, knobs, scope=args.scope, engine=args.engine, belady=args.belady)
    m = res.metrics()
    ep = m.pop("ep", None)  # expert-parallel load (ep_ranks > 1): a section of its own
    dispatch = m.pop("dispatch", None)  # capacity-aware dispatch (dispatch != topk): likewise
    out = {"trace": str(args.trace), "trace_summary": repr(trace),
           "config": res.config, "metrics": m,
           "labels": {"times": "modeled", "replay_s_measured": "measured"}}
    if ep is not None:
        out["ep"] = ep
    if dispatch is not None:
        out["dispatch"] = dispatch
    if args.json:
        print(json.dumps(out, default=float))
        return 0
    c = res.config
    print(f"{trace!r}")
    print(f"eviction={c['eviction']} prefetch={c['prefetch']} (lead {c['prefetch_lead']}) "
          f"cache_slots={c['cache_slots']} pinned_layers={c['pinned_layers']} "
          f"scope={c['scope']} cost={c['cost_source']} on {c['profile']}")
    def num(v, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    def ms(v) -> str:
        return "n/a (no model sizes: --set target_model=NAME)" if v is None else \
            f"{v * 1e3:.2f} ms"

    rows = [("accesses", f"{m['accesses']}"), ("hits / misses", f"{m['hits']} / {m['misses']}"),
            ("hit rate", num(m["hit_rate"], ".4f"))]
    if "belady_hit_rate" in m:
        rows += [("Belady hit rate (bound)", num(m["belady_hit_rate"], ".4f")),
                 ("share of Belady", num(m["share_of_belady"], ".3f"))]
    else:
        rows += [("Belady hit rate (bound)", "not computed (--no-belady)")]
    rows += [("transfers (demand + prefetch)", f"{m['transfers']} ({m['demand_loads']} + "
                                               f"{m['prefetch_loads']})"),
             ("transfer bytes", num(m["transfer_bytes"], ".4g")),
             ("transfer bytes per token", num(m["transfer_bytes_per_token"], ".4g")),
             ("blocking I/O (modeled)", ms(m["blocking_io_s"])),
             ("total I/O (modeled)", ms(m["total_io_s"])),
             ("redundant-transfer share", f"{m['redundant_share']:.3f}"),
             ("fetch precision / prefetch recall",
              f"{m['fetch_precision']:.3f} / {m['prefetch_recall']:.3f}"),
             ("replay time (measured)", f"{m['replay_s_measured'] * 1e3:.1f} ms")]
    if dispatch is not None and dispatch.get("recorded"):
        rows.append((f"dispatch {dispatch['policy']} (γ0 {dispatch['capacity_factor']:g})",
                     "applied live: the stored routing is what it left, replayed as it is"))
    elif dispatch is not None:
        rows.append((f"dispatch {dispatch['policy']} (γ0 {dispatch['capacity_factor']:g})",
                     f"dropped {dispatch['dropped']} of {dispatch['assigned']} assignments "
                     f"({num(dispatch['drop_rate'], '.1%')}), max expert load "
                     f"{dispatch['max_expert_load_before']} → "
                     f"{dispatch['max_expert_load_after']}"))
    if ep is not None:
        rows += _ep_rows(ep, num, ms)
    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a:<{w}}  {b}")
    return 0


def _ep_rows(ep: dict, num, ms) -> list[tuple[str, str]]:
    """The expert-parallel section of ``workbench replay``'s text output."""
    rows = [(f"EP: {ep['ranks']} ranks, {ep['placement']}",
             f"imbalance (max/mean) {num(ep['imbalance'], '.3f')} · balancedness (mean/max) "
             f"{num(ep['balancedness'], '.3f')} · max rank load {ep['max_rank_load']}")]
    for name, sub in (ep.get("by_modality") or {}).items():
        rows.append((f"  {name} tokens", f"imbalance {num(sub['imbalance'], '.3f')} · "
                                        f"balancedness {num(sub['balancedness'], '.3f')}"))
    if "moe_layer_s_modeled" in ep:
        rows.append((f"EP MoE layers (modeled, {ep['interconnect']})",
                     f"dispatch {ms(ep['dispatch_s_modeled'])} + compute "
                     f"{ms(ep['compute_s_modeled'])} + combine {ms(ep['combine_s_modeled'])}"))
    elif "compute_s_modeled" in ep:
        rows.append(("EP compute, slowest rank (modeled)", ms(ep["compute_s_modeled"])))
    return rows


def _info(args) -> int:
    knobs = _knobs_from(args)
    rt = _runtime(args, knobs)
    info = rt.info()
    if args.json:
        print(json.dumps(info))
        return 0
    lay, live, modeled = info["layout"], info["live_plan"], info["modeled_plan"]
    mb = lambda b: f"{b / 1e6:,.2f} MB"  # noqa: E731
    print(f"model: {info['model']} (config {info['config_hash']})")
    print(f"architecture: {lay['architecture']} ({lay['model_type']}"
          f"{'' if lay['tested'] else ', untested'}), vision: {info['vision']}")
    print(f"MoE: {lay['moe_layers']} layers x {lay['experts_per_layer']} experts, "
          f"top-{lay['top_k']}, shared: {', '.join(lay['shared_expert_modules']) or 'none'}, "
          f"{mb(lay['bytes_per_expert'])} per expert")
    for plan in (live, modeled):
        budget = f"{plan['budget_bytes'] / 1e9:.1f} GB" if plan["budget_bytes"] else "unbounded"
        print(f"{plan['label']}: backbone {mb(plan['backbone_bytes'])} + pinned prefix "
              f"{mb(plan['pinned_bytes'])} ({plan['pinned_layers']} layers) + cache "
              f"{mb(plan['cache_bytes'])} ({plan['slots']} slots) = {mb(plan['device_bytes'])} "
              f"on device (budget {budget}, {'fits' if plan['fits'] else 'DOES NOT FIT'}); "
              f"host {mb(plan['host_bytes'])}")
        lo, hi = plan["valid_interval"]
        print(f"  valid pinned prefix: [{lo}, {hi}]{' (empty)' if lo > hi else ''} "
              f"(L_semantic ≤ L ≤ ⌊(M_avail − C_safe)/S_layer⌋: M_avail "
              f"{mb(plan['avail_bytes']) if plan['budget_bytes'] else 'unbounded'}, C_safe "
              f"{mb(plan['reserve_bytes'])} ({plan['reserve_slots']} slots), S_layer "
              f"{mb(plan['layer_bytes'])}); pinned_layers {plan['pinned_layers']} "
              f"{'is valid' if plan['pinned_valid'] else 'is OUTSIDE it'}")
        # why the two plans can differ in cache: each counts the layers of the model it prices
        offloaded = round(plan["host_bytes"] / plan["layer_bytes"]) if plan["layer_bytes"] else 0
        print("  every MoE layer is pinned: nothing is offloaded, so there is no cache and no transfer"
              if offloaded == 0 else
              f"  {offloaded} offloaded layers stay in host memory, served through the "
              f"{plan['slots']} cache slots")
    for note in info["notes"]:
        print(f"note: {note}")
    return 0


def _sweep(args) -> int:
    from workbench.analysis.sweep import SweepInput, parse_grid, sweep

    knobs = _knobs_from(args)
    grid = parse_grid(args.grid)
    inputs = [SweepInput.parse(t) for t in args.inputs] or None
    if args.batch != 1 or args.batch_mix is not None:
        from workbench.analysis.sweep import demo_inputs
        from workbench.models.loading import takes_images

        vision = takes_images(args.model)
        mix = args.batch_mix or ("mixed" if vision else "text")
        inputs = [i.batched(args.batch, mix)
                  for i in inputs or demo_inputs(text_only=not vision)]
    # sweep() checks images, workers, the model folder, --out and the scheduler before any
    # cluster starts
    ds = sweep(grid, inputs, out=args.out, model=args.model, knobs=knobs,
               scheduler=args.scheduler, workers=args.workers, progress=not args.json,
               bar=_progress_wanted(args))
    failed = int((ds.status != "complete").sum())
    if args.json:
        print(json.dumps({"out": args.out, "summary": str(Path(args.out) / "summary.zarr"),
                          "points": int(ds.status.size), "failed": failed,
                          "hit_rate": ds.hit_rate.to_dict()["data"]}, default=str))
    else:
        print(ds.hit_rate.to_dataframe().to_string())
        print(f"{ds.status.size} points, {failed} failed; summary: "
              f"{Path(args.out) / 'summary.zarr'}")
    if failed:  # a sweep with holes is not a success: say which and why, exit non-zero
        bad = ds.status.to_dataframe().join(ds.error.to_dataframe()) if "error" in ds else None
        for index, row in (bad[bad.status != "complete"].iterrows() if bad is not None else []):
            print(f"workbench: point {index} {row.status}: {row.get('error', '') or 'no error recorded'}",
                  file=sys.stderr)
        print(f"workbench: error: {failed} of {ds.status.size} sweep points did not complete "
              f"(their rows are NaN); rerun the same command to retry only those", file=sys.stderr)
        return 1
    return 0


def _dashboard(args) -> int:
    """Serve the dashboard; a port already in use is one line naming it and the way out
    (checked before anything is served: the server's own error names neither)."""
    import errno
    import socket

    from workbench.errors import InputError

    def busy() -> InputError:
        return InputError(f"port {args.port} on {args.address} is in use (another dashboard?); "
                          f"pass --port 0 for any free port, or --port N for another")

    if args.port:
        family = socket.AF_INET6 if ":" in args.address else socket.AF_INET
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                s.bind((args.address, args.port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise busy() from None
                raise
    from workbench.ui.app import serve

    try:
        serve(address=args.address, port=args.port, show=args.show)
    except OSError as e:  # taken between the check and the server's bind
        if e.errno == errno.EADDRINUSE:
            raise busy() from None
        raise
    return 0


def _knobs(args) -> int:
    from workbench.knobs import Knobs, effective_bounds

    k = Knobs()
    rows = []
    for key, group in k.groups.items():
        for name in group.knob_names():
            p = group.param[name]
            # bounds as enforced (ceilings included; "inclusive" says which ends are allowed):
            # the data form of "allowed"
            eb = effective_bounds(p, name) or {"bounds": None, "inclusive": None}
            rows.append({"name": name, "group": key, "default": getattr(group, name),
                         "type": type(p).__name__, **eb,
                         "objects": list(getattr(p, "objects", []) or []) or None,
                         "allowed": k.allowed(name), "doc": p.doc})
    if args.json:
        print(json.dumps(rows, default=str))
        return 0
    for r in rows:
        allowed = r["allowed"]
        print(f"{r['name']:<16} {r['group']:<10} default={r['default']!r:<12} {allowed}")
        print(f"{'':<16} {r['doc']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
