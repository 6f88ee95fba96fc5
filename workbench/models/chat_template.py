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
milliseconds (a spawned interpreter needs ≈ 0.5 s of imports per prompt). A batch's prompts
are rendered by one child (:func:`render_chats`): forking a process that holds a loaded model
costs ≈ 30–40 ms on the 2-core dev machines, which was half the wall time of a batch of 8 on
the embedded model when each prompt forked its own. The bounds stay per prompt: each reply must
come within the time bound of the previous one, and a prompt that runs away is reported as its
own error while the prompts after it are rendered by a fresh child. The child runs only
the template (pure Python) and ``os._exit``\\ s; it never returns into the parent's stack.
Compiling is bounded too: Jinja folds constants at compile time, so ``'a' * 3000000000`` is
evaluated by the compiler (in the child, never in the parent). Where ``os.fork`` is missing
(Windows) the template is rendered in-process, unbounded.

A conversation rendered once is not rendered again by the same template (a memo of at most
:data:`MEMO_CHARS` characters, by a hash of the renderer's class, template, special tokens and
the conversation): re-running a prompt with other knobs — the dashboard, sweeps, benchmarks —
forked a child each time (≈ 45 of a run's 50 ms before generation, embedded model). Not kept:
failures, and renderings of a template that may render differently next time (the clock,
Jinja's ``random`` and ``lipsum``).
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import threading
import time
from collections import OrderedDict
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
    out = render_chats(tokenizer, [messages], seconds=seconds)[0]
    if isinstance(out, TemplateRenderError):
        raise out
    return out


def render_chats(tokenizer: Any, conversations: list[list[dict[str, Any]]], *,
                 seconds: float | None = None, stop_at_error: bool = False
                 ) -> list[str | TemplateRenderError]:
    """:func:`render_chat` of each conversation, in order, by one child process where nothing
    goes wrong: each item is the rendered text or the :class:`TemplateRenderError` of that
    conversation (returned, not raised: the caller names which request failed). Each rendering
    has its own time bound ``seconds`` (from the previous reply). ``stop_at_error``: return
    at the first error (the list ends with it) — a caller that refuses the whole batch on any
    error must not wait out the time bound once per prompt of a template that hangs on all."""
    seconds = render_seconds() if seconds is None else seconds
    # a conversation rendered before by the same template is not rendered again (each
    # rendering forks a child): the texts kept are ones a bounded rendering gave
    keys = [_memo_key(tokenizer, m) for m in conversations]
    kept = _MEMO.get(keys)
    todo = [m for m, text in zip(conversations, kept) if text is None]
    rendered = iter(_render(tokenizer, todo, seconds, stop_at_error) if todo else [])
    out: list[str | TemplateRenderError] = []
    for key, text in zip(keys, kept):
        if text is None:
            text = next(rendered, None)
            if text is None:  # stop_at_error: the rendering ended at an error
                break
            if key is not None and not isinstance(text, TemplateRenderError):
                _MEMO.put(key, text)
        out.append(text)
        if stop_at_error and isinstance(text, TemplateRenderError):
            break
    return out


class _Memo:
    """Rendered texts by key, least recently used first, at most :data:`MEMO_CHARS` charged
    (each text its length plus :data:`MEMO_ENTRY_CHARS` for its entry: many tiny texts are
    bounded too); a running total, so keeping one costs the same whatever the memo holds."""

    def __init__(self) -> None:
        self.texts: OrderedDict[str, str] = OrderedDict()
        self.charged = 0
        self.lock = threading.Lock()

    def get(self, keys: list[str | None]) -> list[str | None]:
        with self.lock:
            out = []
            for k in keys:
                text = None if k is None else self.texts.get(k)
                if text is not None:
                    self.texts.move_to_end(k)
                out.append(text)
            return out

    def put(self, key: str, text: str) -> None:
        if len(text) > MEMO_TEXT_CHARS:
            return
        with self.lock:
            old = self.texts.pop(key, None)
            if old is not None:
                self.charged -= len(old) + MEMO_ENTRY_CHARS
            self.texts[key] = text
            self.charged += len(text) + MEMO_ENTRY_CHARS
            while self.charged > MEMO_CHARS and self.texts:
                self.charged -= len(self.texts.popitem(last=False)[1]) + MEMO_ENTRY_CHARS


#: rendered texts kept by :func:`render_chats`, by :func:`_memo_key`: a run of the same
#: prompt with other knobs — the dashboard, a sweep, a benchmark — renders it once (a
#: rendering forks a child: ≈ 45 ms of a run of the embedded model here)
_MEMO = _Memo()
#: what the kept texts are charged, at most (the least recently used go first)
MEMO_CHARS = 1 << 22
#: what each kept text is charged beyond its characters (its entry and key)
MEMO_ENTRY_CHARS = 256
#: a text longer than this is not kept
MEMO_TEXT_CHARS = 1 << 16
#: a template naming one of these renders differently from one call to the next (the clock;
#: Jinja's ``random`` filter and ``lipsum``): never kept
_UNSTABLE = ("strftime_now", "random", "lipsum")


def _plain(value: Any, depth: int = 0) -> bool:
    """JSON's own types only — str-keyed dicts, lists, str, int, float, bool, None — so the
    JSON text is the value (a tuple or an int key would write as a list or a str key, which a
    template may tell apart)."""
    if depth > 32:
        return False
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if type(value) is list:
        return all(_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _memo_key(tokenizer: Any, messages: Any) -> str | None:
    """What a rendering depends on, hashed: the renderer's class, its template, its special
    tokens and the conversation (the flags are fixed). None — never kept — when one of them is
    not plain JSON (:func:`_plain`), the renderer has no template attribute, or the template
    may render differently next time (:data:`_UNSTABLE`)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    special = getattr(tokenizer, "special_tokens_map", None)
    if special is None:  # a processor: its tokenizer's
        special = getattr(getattr(tokenizer, "tokenizer", None), "special_tokens_map", None)
    if not (_plain(template) and _plain(special) and _plain(messages)):
        return None
    cls = type(tokenizer)
    try:
        source = json.dumps(template, ensure_ascii=False)
        text = json.dumps([cls.__module__, cls.__qualname__, source, special, messages],
                          sort_keys=True, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    if any(word in source for word in _UNSTABLE):
        return None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _render(tokenizer: Any, conversations: list[list[dict[str, Any]]], seconds: float,
            stop_at_error: bool) -> list[str | TemplateRenderError]:
    """:func:`render_chats` without the memo."""

    def call(messages) -> Any:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)

    out: list[str | TemplateRenderError] = []
    if not hasattr(os, "fork"):
        for messages in conversations:
            try:
                out.append(_check_text(call(messages)))
            except TemplateRenderError as e:
                out.append(e)
            except Exception as e:  # the template's own error
                out.append(TemplateRenderError(_one_line(e)))
            if stop_at_error and isinstance(out[-1], TemplateRenderError):
                break
        return out
    _preimport()
    while len(out) < len(conversations):  # a fresh child for what a failed one left
        out.extend(_in_child(call, conversations[len(out):], seconds, stop_at_error))
        if stop_at_error and any(isinstance(o, TemplateRenderError) for o in out):
            return out
    return out


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


def _reply(call, messages) -> list:
    """["ok", text] or ["error", one line] for one conversation (in the child)."""
    try:
        out = call(messages)
        if not isinstance(out, str):
            return ["error", f"it rendered a {type(out).__name__}, not text"]
        if len(out) > MAX_RENDERED_CHARS:
            return ["error", f"it rendered more than {MAX_RENDERED_CHARS:,} characters"]
        return ["ok", out]
    except MemoryError:
        return ["error", f"it needed more than {RENDER_MEMORY / 2**30:g} GiB of memory"]
    except BaseException as e:  # noqa: BLE001 — the template's error, reported in one line
        return ["error", _one_line(e)]


def _die_with(parent: int) -> None:
    """In the child: be killed when the parent dies. The child blocks every signal and may be
    inside a runaway template, so a parent killed by SIGTERM (its ``finally`` never runs)
    would leave it spinning forever; Linux's parent-death signal (SIGKILL cannot be blocked)
    ends it. Where prctl is missing, the time bound is the parent's to enforce, as before."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _child(call, conversations, w: int) -> None:
    """Runs in the forked child: render each conversation, write one length-prefixed JSON
    reply per conversation as it is done, exit."""
    _limit_memory()
    for messages in conversations:
        data = json.dumps(_reply(call, messages)).encode()
        view = memoryview(len(data).to_bytes(8, "big") + data)
        while view:
            n = os.write(w, view)
            view = view[n:]


def _in_child(call, conversations, seconds: float, stop_at_error: bool = False
              ) -> list[str | TemplateRenderError]:
    """Render ``conversations`` in one forked child: a result per conversation up to and
    including the first that exceeded a bound (fewer than asked when the child was stopped:
    the caller renders the rest in a new child), or the first error with ``stop_at_error``."""
    r, w = os.pipe()
    parent = os.getpid()
    # the child starts with every signal blocked (a Ctrl-C must not unwind the parent's stack
    # in it; SIGKILL, which ends it, cannot be blocked); the parent's mask is restored at once
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
    except OSError as e:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        os.close(r)
        os.close(w)
        err = TemplateRenderError(f"could not start the rendering process ({e})")
        return [err] * len(conversations)
    if pid == 0:  # pragma: no cover — the child (coverage does not follow it)
        code = 1
        try:
            os.close(r)
            _die_with(parent)
            _child(call, conversations, w)
            code = 0
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
    os.close(w)
    out: list[str | TemplateRenderError] = []
    try:
        frames = _Frames(r)
        for _ in conversations:
            try:
                data = frames.next(seconds)
            except TemplateRenderError as e:  # this one ran past the time bound
                out.append(e)
                break
            try:
                status, value = json.loads(data)
            except ValueError:
                out.append(TemplateRenderError("the rendering process ended without a result "
                                               "(killed or out of memory)"))
                break
            if status != "ok":
                out.append(TemplateRenderError(value))
                if stop_at_error:
                    break
                continue
            try:
                out.append(_check_text(value))
            except TemplateRenderError as e:
                out.append(e)
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
    return out


class _Frames:
    """The child's replies on pipe ``r``: each an 8-byte length, then that many bytes."""

    def __init__(self, r: int) -> None:
        self.r, self.buf = r, bytearray()
        self.poller = select.poll()
        self.poller.register(r, select.POLLIN)

    def next(self, seconds: float) -> bytes:
        """The next reply, read until complete (not until EOF: a process forked meanwhile by
        another thread may hold the pipe's write end) within ``seconds``; ``b""`` when the
        child ended first (killed, out of memory)."""
        cap = 12 * MAX_RENDERED_CHARS + 4096  # ASCII JSON: ≤ 12 bytes a character
        deadline = time.monotonic() + seconds
        buf = self.buf
        need = None
        while need is None or len(buf) < 8 + need:
            if need is None and len(buf) >= 8:
                need = int.from_bytes(buf[:8], "big")
                if need > cap:
                    raise TemplateRenderError(f"it rendered more than "
                                              f"{MAX_RENDERED_CHARS:,} characters")
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemplateRenderError(f"rendering took longer than {seconds:g} s (the "
                                          f"bound; {SECONDS_ENV} changes it)")
            if not self.poller.poll(max(1, int(left * 1000))):
                continue
            chunk = os.read(self.r, 1 << 20)
            if not chunk:
                return b""  # the child ended early
            buf += chunk
        data = bytes(buf[8:8 + need])
        del buf[:8 + need]
        return data


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]
