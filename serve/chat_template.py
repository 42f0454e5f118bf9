"""Chat templates sent by clients, rendered in a sandbox (only with ``--trust_request_chat_template``;
the server refuses them otherwise).

A client template is Jinja code from the network. It is rendered:

- in Jinja's immutable sandbox (no access to internals, no mutation of the inputs), with the
  globals and filters chat templates expect (``raise_exception``, ``strftime_now``, ``tojson``, loop
  controls); repetition, powers and integer arguments (``range``, widths) are capped;
- in a separate worker process (this file run as a script: it imports only the standard library
  and Jinja) whose address space is capped (``RLIMIT_AS``), so a template that builds a huge string
  fails there with ``MemoryError`` instead of exhausting the server's memory;
- under a deadline: checked on every line the template's compiled code runs (a trace function on
  template frames), and enforced from outside by killing the worker if it does not answer.

The server calls :class:`TemplateSandbox` from a worker thread (``serve/preprocess.py``), never from
the event loop. Renders are serialized per worker process.
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import Any

MAX_INT_ARGUMENT = 100_000  # range(), widths, repeat counts a template may ask for
MAX_REPEAT_RESULT = 1_000_000  # items or characters one '*' may produce
MAX_POWER_BITS = 4096
MAX_SOURCE_CHARS = 64 * 1024  # of the template itself
WORKER_MEMORY_BYTES = 1 << 30
KILL_GRACE_SECONDS = 1.0  # past the deadline before the worker is killed from outside


# ---- the worker process: a bounded Jinja sandbox -------------------------------------------------


def _check_ints(args, kwargs=None) -> None:
    from jinja2.exceptions import SecurityError

    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARGUMENT:
            raise SecurityError(f"the number {value} is too large for a chat template (at most {MAX_INT_ARGUMENT})")


def _check_binop(operator: str, left, right) -> None:
    from jinja2.exceptions import SecurityError

    if operator == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and left.bit_length() * right > MAX_POWER_BITS:
            raise SecurityError("the power is too large for a chat template")
    elif operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_REPEAT_RESULT:
                raise SecurityError("the repetition is too large for a chat template")
        _check_ints((left, right))


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
            _check_ints(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    def bounded(fn):
        @functools.wraps(fn)  # (keeps Jinja's pass_context/pass_environment markers)
        def call(*args, **kwargs):
            _check_ints(args, kwargs)
            return fn(*args, **kwargs)

        return call

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # chat templates expect HF's tojson: no HTML escaping, indent/separators options
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters = {name: bounded(fn) for name, fn in env.filters.items()}
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class _DeadlineExceeded(Exception):
    pass


def render(source: str, variables: dict[str, Any], timeout: float, max_chars: int) -> str:
    """Render in this process under a deadline; ``ValueError`` for anything wrong, slow or too big."""
    deadline = time.monotonic() + timeout

    def trace_lines(frame, event, arg):
        if time.monotonic() > deadline:
            raise _DeadlineExceeded
        return trace_lines

    def trace_calls(frame, event, arg):  # Jinja compiles templates under the file name "<template>"
        return trace_lines if frame.f_code.co_filename == "<template>" else None

    parts, length = [], 0
    sys.settrace(trace_calls)
    try:
        for chunk in _environment().from_string(source).generate(**variables):
            length += len(chunk)
            if length > max_chars:
                raise ValueError(f"the rendered chat template is longer than {max_chars} characters")
            parts.append(chunk)
    except _DeadlineExceeded:
        raise ValueError(f"the chat template took longer than {timeout:g} s to render") from None
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 (syntax, sandbox, type errors, raise_exception, MemoryError)
        raise ValueError(f"cannot render the chat template: {type(exc).__name__}: {exc}") from None
    finally:
        sys.settrace(None)
    return "".join(parts)


def _worker_main() -> None:
    """One JSON request per line on stdin, one JSON answer per line on stdout."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = {"text": render(request["source"], request["variables"], request["timeout"], request["max_chars"])}
        except ValueError as exc:
            answer = {"error": str(exc)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


# ---- the server side --------------------------------------------------------------------------


class TemplateSandbox:
    """Renders client templates in a worker process (started on first use, restarted when killed)."""

    def __init__(self, timeout: float, max_chars: int):
        self.timeout, self.max_chars = timeout, max_chars
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def render(self, source: str, variables: dict[str, Any]) -> str:
        """The rendered text; ``ValueError`` (a 400) when the template is bad, slow or too big."""
        if len(source) > MAX_SOURCE_CHARS:
            raise ValueError(f"the chat template is longer than {MAX_SOURCE_CHARS} characters")
        request = json.dumps({"source": source, "variables": variables, "timeout": self.timeout,
                              "max_chars": self.max_chars}, default=str)
        with self._lock:
            answer = self._ask(request + "\n")
        if "error" in answer:
            raise ValueError(answer["error"])
        return answer["text"]

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _ask(self, request: str) -> dict:
        proc = self._worker()
        try:
            proc.stdin.write(request)
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout + KILL_GRACE_SECONDS)
            line = proc.stdout.readline() if ready else ""
        except OSError:
            line = ""
        if not line:  # too slow, or the worker died (out of its memory)
            self._kill()
            return {"error": f"the chat template did not render within {self.timeout:g} s or its memory limit"}
        return json.loads(line)

    def _worker(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True, encoding="utf-8",
            )
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


if __name__ == "__main__":
    _worker_main()
