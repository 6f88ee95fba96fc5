"""Rendering a model's chat template, bounded in time, memory and output size.

A chat template is a Jinja program shipped with the checkpoint; transformers renders it in a
sandbox that stops attribute escapes but not amplification: ``{{ 'a' * 3000000000 }}``
allocates 6 GB, and a template may loop only for some prompts (so a check at load passes and a
run hangs). Amplification has many spellings (``*``, ``join``, ``center``, ``format`` widths,
``replace``…), so the bound is by class, not by operator: every prompt is rendered by
``tokenizer.apply_chat_template`` itself (transformers' own code, unchanged) in a forked child
that has at most :data:`RENDER_MEMORY` bytes of address space more than the parent, is killed
after :func:`render_seconds`, and may return at most :data:`MAX_RENDERED_CHARS` characters.

Fork rather than spawn: the child shares the loaded tokenizer copy-on-write and starts in
milliseconds (a spawned interpreter needs ≈ 0.5 s of imports per prompt). The child runs only
the template (pure Python) and ``os._exit``\\ s; it never returns into the parent's stack.
Compiling is bounded too: Jinja folds constants at compile time, so ``'a' * 3000000000`` is
evaluated by the compiler (in the child, never in the parent). Where ``os.fork`` is missing
(Windows) the template is rendered in-process, unbounded.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from typing import Any

from workbench.errors import InputError

#: address space the rendering child may take beyond the parent's, bytes
RENDER_MEMORY = 1 << 30
#: longest rendered prompt accepted, characters (twice the longest prompt, plus 1 Mi of
#: template text: a template wraps the prompt, it does not multiply it)
MAX_RENDERED_CHARS = 2 * 4 * 1024 * 1024 + (1 << 20)
#: default time bound of one rendering, seconds (a real template renders in milliseconds)
RENDER_SECONDS = 5.0
#: environment variable that changes the time bound
SECONDS_ENV = "WORKBENCH_TEMPLATE_SECONDS"


class TemplateRenderError(Exception):
    """The template failed, or exceeded a bound; the message is one line."""


def render_seconds() -> float:
    """The time bound: ``$WORKBENCH_TEMPLATE_SECONDS`` (a number > 0) or :data:`RENDER_SECONDS`;
    :class:`InputError` for another value (the setting's fault, not the template's)."""
    raw = os.environ.get(SECONDS_ENV)
    if raw is None:
        return RENDER_SECONDS
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise InputError(f"{SECONDS_ENV}={raw!r} is not a number of seconds > 0")
    return v


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *,
                seconds: float | None = None) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
    within the bounds of this module; :class:`TemplateRenderError` names the bound exceeded or
    the template's own error (every failure of the rendering is one, in one line)."""
    seconds = render_seconds() if seconds is None else seconds

    def call() -> Any:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)

    if not hasattr(os, "fork"):
        try:
            out = call()
        except Exception as e:  # the template's own error
            raise TemplateRenderError(_one_line(e)) from None
        return _check_text(out)
    _preimport()
    return _check_text(_in_child(call, seconds))


def _preimport() -> None:
    """Import what rendering imports, here: a fork copies another thread's held import lock
    into the child, where nothing would release it (a deadlock the time bound would report)."""
    import jinja2  # noqa: F401
    import jinja2.sandbox  # noqa: F401

    try:
        import transformers.utils.chat_template_utils  # noqa: F401
    except ImportError:
        pass


def _check_text(out: Any) -> str:
    if not isinstance(out, str):
        raise TemplateRenderError(f"it rendered a {type(out).__name__}, not text")
    if len(out) > MAX_RENDERED_CHARS:
        raise TemplateRenderError(f"it rendered {len(out):,} characters, more than the "
                                  f"{MAX_RENDERED_CHARS:,} allowed")
    return out


def _vm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _limit_memory() -> None:
    """At most :data:`RENDER_MEMORY` more address space than now, within the hard limit."""
    import resource

    vm = _vm_bytes()
    if vm is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + RENDER_MEMORY
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _child(call, w: int) -> None:
    """Runs in the forked child: render, write one length-prefixed JSON reply, exit."""
    try:
        _limit_memory()
        out = call()
        if not isinstance(out, str):
            reply = ["error", f"it rendered a {type(out).__name__}, not text"]
        elif len(out) > MAX_RENDERED_CHARS:
            reply = ["error", f"it rendered more than {MAX_RENDERED_CHARS:,} characters"]
        else:
            reply = ["ok", out]
    except MemoryError:
        reply = ["error", f"it needed more than {RENDER_MEMORY / 2**30:g} GiB of memory"]
    except BaseException as e:  # noqa: BLE001 — the template's error, reported in one line
        reply = ["error", _one_line(e)]
    data = json.dumps(reply).encode()
    view = memoryview(len(data).to_bytes(8, "big") + data)
    while view:
        n = os.write(w, view)
        view = view[n:]


def _in_child(call, seconds: float) -> Any:
    r, w = os.pipe()
    # the child starts with every signal blocked (a Ctrl-C must not unwind the parent's stack
    # in it; SIGKILL, which ends it, cannot be blocked); the parent's mask is restored at once
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
    except OSError as e:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        os.close(r)
        os.close(w)
        raise TemplateRenderError(f"could not start the rendering process ({e})") from None
    if pid == 0:  # pragma: no cover — the child (coverage does not follow it)
        code = 1
        try:
            os.close(r)
            _child(call, w)
            code = 0
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
    os.close(w)
    try:
        data = _read_reply(r, seconds)
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # SIGCHLD ignored: the kernel reaped it
            pass
    try:
        status, value = json.loads(data)
    except ValueError:
        raise TemplateRenderError("the rendering process ended without a result "
                                  "(killed or out of memory)") from None
    if status != "ok":
        raise TemplateRenderError(value)
    return value


def _read_reply(r: int, seconds: float) -> bytes:
    """The child's reply: an 8-byte length, then that many bytes. Read until complete (not
    until EOF: a process forked meanwhile by another thread may hold the pipe's write end),
    within ``seconds``."""
    cap = 12 * MAX_RENDERED_CHARS + 4096  # ASCII JSON: ≤ 12 bytes a character
    poller = select.poll()
    poller.register(r, select.POLLIN)
    deadline = time.monotonic() + seconds
    buf = bytearray()
    need = None
    while need is None or len(buf) < 8 + need:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TemplateRenderError(f"rendering took longer than {seconds:g} s (the bound; "
                                      f"{SECONDS_ENV} changes it)")
        if not poller.poll(max(1, int(left * 1000))):
            continue
        chunk = os.read(r, 1 << 20)
        if not chunk:
            break  # the child ended early (killed, out of memory)
        buf += chunk
        if need is None and len(buf) >= 8:
            need = int.from_bytes(buf[:8], "big")
            if need > cap:
                raise TemplateRenderError(f"it rendered more than {MAX_RENDERED_CHARS:,} "
                                          f"characters")
    return bytes(buf[8:8 + need]) if need is not None and len(buf) >= 8 + need else b""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]
