"""What every HTTP request passes before a handler sees it: the API key, then the body size.

- The key (``--api_key``, repeatable, and/or ``--api_key_file``, one key per line, re-read when the
  file changes so keys rotate without a restart) is required as ``Authorization: Bearer KEY`` on
  every route except ``/health`` (and ``/metrics`` with ``--metrics_without_key``). A key file
  with no keys in it refuses everyone: the guard fails closed.
- The body is read here, up to ``--max_request_body_bytes``: a larger declared ``Content-Length``
  gets 413 before anything is read, a larger body 413 as soon as it passes the limit, so no handler,
  JSON parser or tokenizer ever sees it. The rest of a body of up to ``DISCARD_LIMIT_BYTES`` is then
  read and dropped, so the client, still sending, gets to read the 413 instead of a reset
  connection; a larger one is cut off.

A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would hide client disconnects from the
handlers (``Request.is_disconnected``), and those abort requests.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from fastapi.responses import JSONResponse

from .errors import error_body

log = logging.getLogger("autodeploy.serve.guards")

OPEN_PATHS = frozenset({"/health"})
KEY_FILE_RECHECK_SECONDS = 1.0
DISCARD_LIMIT_BYTES = 32 * 2**20  # a refused body larger than this is cut off, not read to its end


class APIKeys:
    """The keys the server accepts: those given, plus those in a key file (re-read when it changes)."""

    def __init__(self, keys: str | Sequence[str] | None = None, key_file: str | os.PathLike | None = None):
        self._keys = tuple(k.encode() for k in ([keys] if isinstance(keys, str) else keys or ()) if k)
        self._file = Path(key_file) if key_file else None
        self._file_keys: tuple[bytes, ...] = ()
        self._file_stamp: tuple[float, int] | None = None
        self._checked = 0.0
        if self._file is not None:
            self._reload(strict=True)

    @property
    def enabled(self) -> bool:
        return bool(self._keys) or self._file is not None

    def accepts(self, authorization: bytes) -> bool:
        """Whether an ``Authorization`` header carries one of the keys (each compared in constant time)."""
        scheme, _, given = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        given = given.strip()
        return any([hmac.compare_digest(given, key) for key in (*self._keys, *self._current_file_keys())])

    def _current_file_keys(self) -> tuple[bytes, ...]:
        if self._file is not None and time.monotonic() - self._checked > KEY_FILE_RECHECK_SECONDS:
            self._reload(strict=False)
        return self._file_keys

    def _reload(self, strict: bool) -> None:
        self._checked = time.monotonic()
        try:
            stat = self._file.stat()
            stamp = (stat.st_mtime, stat.st_size)
            if stamp != self._file_stamp:
                lines = self._file.read_text().splitlines()
                self._file_keys = tuple(line.strip().encode() for line in lines
                                        if line.strip() and not line.lstrip().startswith("#"))
                self._file_stamp = stamp
        except OSError as exc:
            if strict:
                raise ValueError(f"cannot read the API key file {self._file}: {exc}") from exc
            log.warning("cannot re-read the API key file %s (%s); keeping the keys read before", self._file, exc)


class RequestGuard:
    """ASGI middleware: the API key, then the body size limit (see the module docstring)."""

    def __init__(self, app, keys: APIKeys, max_body_bytes: int, metrics_without_key: bool = False):
        self.app, self.keys, self.max_body_bytes = app, keys, max_body_bytes
        self.open_paths = OPEN_PATHS | ({"/metrics"} if metrics_without_key else set())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.keys.enabled and scope["path"] not in self.open_paths:
            if not self.keys.accepts(headers.get(b"authorization", b"")):
                return await _reply(scope, receive, send, 401, "invalid or missing API key",
                                    {"WWW-Authenticate": "Bearer"})
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit():
            return await _reply(scope, receive, send, 400, "invalid Content-Length header")
        body = None if int(declared) > self.max_body_bytes else await _read_body(receive, self.max_body_bytes)
        if body is None:
            await _reply(scope, receive, send, 413, self._too_large())
            if int(declared) <= DISCARD_LIMIT_BYTES:
                await _discard_body(receive)
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> str:
        return (f"the request body is larger than {self.max_body_bytes} bytes "
                "(the server's --max_request_body_bytes)")


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes ``limit`` bytes (a disconnect ends it early)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)  # disconnected: the handler will see it on its next receive
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _discard_body(receive) -> None:
    dropped = 0
    while dropped <= DISCARD_LIMIT_BYTES:  # (a chunked body declares no length: bounded here)
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))


def _replay(body: bytes, receive):
    """A ``receive`` that hands out the body read already, then passes on to the real one
    (which reports the client's disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(scope, receive, send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    await JSONResponse(error_body(status, message), status_code=status, headers=headers)(scope, receive, send)
