"""Grammar compilation with xgrammar, in this process or in an isolated worker process under a deadline.

A request's grammar (``StructuredOutput``: a JSON schema, regex, choice list or EBNF grammar) is compiled
against the tokenizer's vocabulary into xgrammar's ``CompiledGrammar``. Some grammars are expensive (a
20000-value enum took 15 s here, a 200-deep nested schema 3 s), and a compile cannot be interrupted, so the
server compiles in a worker process (this file run as a script) that it kills when the deadline passes,
whose address space is capped; the compiled grammar comes back serialized (xgrammar's JSON form: 10-200
KB, tens of ms) and is rebuilt next to the sampler.

Protocol: one JSON line per message. The worker reads the tokenizer's serialized ``TokenizerInfo`` first,
answers ``{"ready": true}``, then answers each ``{"kind", "spec"}`` with ``{"compiled": JSON}`` or
``{"error": reason}``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import Any

WORKER_EXTRA_MEMORY_BYTES = 4 << 30  # address space a compile may add to the worker's after its imports
WORKER_START_SECONDS = 120.0  # importing xgrammar (and torch) and reading the vocabulary


class GrammarError(ValueError):
    """The grammar cannot be compiled (the reason is xgrammar's), or not within the limits."""


def compile_with(compiler: Any, kind: str, spec: str) -> Any:
    """xgrammar's ``CompiledGrammar`` of one structured-output spec; ``GrammarError`` with xgrammar's reason."""
    try:
        if kind == "json":
            import xgrammar

            grammar = xgrammar.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
            return compiler.compile_grammar(_without_raw_control_characters(str(grammar)))
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec))
        if kind == "grammar":
            return compiler.compile_grammar(spec)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 (xgrammar raises RuntimeError/ValueError with the reason)
        raise GrammarError(f"cannot compile the {kind} grammar: {_reason(exc)}") from None
    raise GrammarError(f"unknown structured output kind '{kind}'")


# xgrammar 0.2.9 writes the characters of a length-bounded string (minLength/maxLength) as this class, which
# lets raw control characters (a tab, U+001E...) into the string: not JSON (json.loads refuses it). Its
# unbounded strings exclude them; the same exclusion is written into the bounded ones.
_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'


def _without_raw_control_characters(ebnf: str) -> str:
    return ebnf.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)


def choice_grammar(spec: str) -> str:
    """The EBNF grammar of a JSON array of strings: exactly one of them."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"a choice spec must be a JSON array of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("a choice needs a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix ("[time] /project/cpp/x.cc:12: ")."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition("] ")
        if rest.startswith("/") and ": " in rest:
            text = rest.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(exc).__name__


# ---- the worker process ------------------------------------------------------------------------------------


def _cap_address_space() -> None:
    import resource

    with open("/proc/self/status") as status:
        size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = size_kb * 1024 + WORKER_EXTRA_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _worker_main() -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(sys.stdin.readline())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _cap_address_space()
    _answer({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            _answer({"compiled": compile_with(compiler, request["kind"], request["spec"]).serialize_json()})
        except GrammarError as exc:
            _answer({"error": str(exc)})
        except MemoryError:
            _answer({"error": "the grammar needs more memory than a grammar may take"})


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class GrammarWorker:
    """One worker process (started on first use, restarted after it is killed); callers serialize on a lock."""

    def __init__(self, tokenizer_info_json: str):
        self._info = tokenizer_info_json
        self._proc: subprocess.Popen | None = None

    def compile(self, kind: str, spec: str, timeout: float) -> str:
        """The serialized compiled grammar; ``GrammarError`` when it is bad, too slow or too big."""
        proc = self._started()
        answer = self._ask(proc, json.dumps({"kind": kind, "spec": spec}) + "\n", timeout)
        if answer is None:
            self.close()
            raise GrammarError(f"the grammar did not compile within {timeout:g} s (the server's "
                               "--grammar_compile_timeout) or its memory limit")
        if "error" in answer:
            raise GrammarError(answer["error"])
        return answer["compiled"]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                      encoding="utf-8", env=env)
        if self._ask(self._proc, self._info + "\n", WORKER_START_SECONDS) is None:
            self.close()
            raise GrammarError("the grammar compiler's worker process did not start")
        return self._proc

    @staticmethod
    def _ask(proc: subprocess.Popen, request: str, timeout: float) -> dict | None:
        try:
            proc.stdin.write(request)
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else ""
        except OSError:
            line = ""
        return json.loads(line) if line else None


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # this folder's modules (serve/tokenizer.py...) must not shadow the libraries'
    _worker_main()
