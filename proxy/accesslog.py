"""The structured access log: one JSON line per request on logger `vllm_proxy.access`.

Fields: ts, request_id, endpoint, deployment, backend, route (the routing reason), status,
stream, ttft_ms, duration_ms, overhead_ms, prompt_tokens, completion_tokens (when the upstream
reported usage), key (the client key's configured name; null without auth or when the key was
refused), worker (0 … N-1 under `serve --workers N`). Never prompt or completion content, never
keys or headers.

Cost: with `logging.access_log: false` the request path makes one `is None` test. When on,
a request that the logger level or the sampling drops costs a level check and a random draw;
a written line costs a tuple of its fields appended to the writer's batch, formatted with the
batch when it is written (see LineWriter). Formatted one by one as requests ended, each line
cost ~5 us in the server against ~2 us in a loop (the formatting code and data are cold between
requests): 11-12 % of the production configuration's throughput at c=32, against 4-7 % deferred
(`python -m loadtest.overhead`; docs/BENCHMARKS.md). Token counts come from a bounded regex
search at the `"usage"` key of the body (non-streaming) or of the last data chunk (streaming,
when the client asked for `stream_options.include_usage`); nothing else of the response is
looked at.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import os
import random
import re
import stat
import threading
import time
from typing import Final

import orjson

from proxy.config import LoggingConfig
from proxy.logsetup import worker_id

LOGGER: Final = "vllm_proxy.access"
log: Final = logging.getLogger(LOGGER)
LEVELS: Final = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}

_USAGE: Final = re.compile(rb'"usage"\s*:\s*\{')
# chat/completions/embeddings say prompt/completion_tokens; the Responses API input/output_tokens
_PROMPT: Final = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION: Final = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_USAGE_WINDOW: Final = 1024  # bytes after `"usage":{` that may hold the counts
# vLLM's compact layout (and OpenAI's), read by hand (`_compact`) on every answer: 2.4 k
# instructions a request less than one regular expression match (loadtest.instructions, compiled);
# anything else takes the searches
_COMPACT_PROMPT: Final = b'"usage":{"prompt_tokens":'
_COMPACT_TOTAL: Final = b'"total_tokens":'
_COMPACT_COMPLETION: Final = b'"completion_tokens":'


def usage_tokens(buf: bytes | None) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of the last `"usage": {...}` object in `buf`."""
    if not buf:
        return None, None
    at = buf.rfind(b'"usage"')
    if at < 0:
        return None, None
    if buf.startswith(_COMPACT_PROMPT, at):
        compact = _compact(buf, at)
        if compact is not None:
            return compact
    if _USAGE.match(buf, at) is None:
        return None, None
    end = at + _USAGE_WINDOW
    prompt = _PROMPT.search(buf, at, end)
    completion = _COMPLETION.search(buf, at, end)
    return (int(prompt.group(1)) if prompt else None), (int(completion.group(1)) if completion else None)


def _compact(buf: bytes, at: int) -> tuple[int, int] | None:
    """`"usage":{"prompt_tokens":P,["total_tokens":T,]"completion_tokens":C` at `at`, within
    _USAGE_WINDOW bytes: (P, C), or None for any other layout."""
    limit = at + _USAGE_WINDOW
    limit = len(buf) if len(buf) < limit else limit
    i = at + len(_COMPACT_PROMPT)
    prompt, end = _number(buf, i, limit)
    if end == i or end >= limit or buf[end] != 44:  # (44: ",")
        return None
    i = end + 1
    if buf.startswith(_COMPACT_TOTAL, i):
        i += len(_COMPACT_TOTAL)
        _, end = _number(buf, i, limit)
        if end == i or end >= limit or buf[end] != 44:
            return None
        i = end + 1
    if not buf.startswith(_COMPACT_COMPLETION, i):
        return None
    i += len(_COMPACT_COMPLETION)
    completion, end = _number(buf, i, limit)
    return None if end == i else (prompt, completion)


def _number(buf: bytes, i: int, limit: int) -> tuple[int, int]:
    """(the decimal number at `i`, where its digits end), reading no further than `limit`."""
    value = 0
    while i < limit:
        digit = buf[i] - 48
        if digit < 0 or digit > 9:
            break
        value = value * 10 + digit
        i += 1
    return value, i


_FIXED_MAX: Final = 4096


# an access-log line's fields, as AccessLog.write takes them (typed: compiled, `_format` reads them unboxed):
# ts, request id, endpoint, deployment, backend, route, status, stream, duration, ttft, overhead (seconds),
# (prompt, completion) tokens, key, worker
Fields = tuple[float, str, str, str, str, "str | None", str, bool, float, "float | None", "float | None",
               "tuple[int | None, int | None]", "str | None", int]


def fixed3(value: float) -> bytes:
    """`b"%.3f" % value`, by integer arithmetic for the values a log line has (non-negative, below
    1e12): %-formatting a float cost ~2k instructions (callgrind), a line's three of them half of it."""
    if not 0.0 <= value < 1e12:  # (NaN included)
        return b"%.3f" % value
    n = int(value * 1000.0 + 0.5)
    return str(n // 1000).encode() + _THOUSANDTHS[n % 1000]


_THOUSANDTHS: Final = tuple(b".%03d" % i for i in range(1000))


def _format(fields: Fields) -> bytes:
    """One access-log line from the fields `AccessLog.write` took. The fields that repeat from
    request to request (endpoint, deployment, backend, route, stream, key, worker) are serialized
    once per combination (`_fragments`), the rest formatted here and joined: a third of the cost of
    dumping a fresh dict for every line, and half that of one bytes %-format of them all."""
    (ts, request_id, endpoint, deployment, backend, route, status, stream, duration_s, ttft_s, overhead_s,
     tokens, key, worker) = fields
    fixed = (endpoint, deployment, backend, route, stream, key, worker)
    parts = _FRAGMENTS.get(fixed)
    if parts is None:
        parts = _fragments(fixed)
    prompt_tokens, completion_tokens = tokens
    return b"".join((
        b'{"ts":', fixed3(ts), b',"request_id":', orjson.dumps(request_id), parts[0], str(int(status)).encode(),
        parts[1], b"null" if ttft_s is None else fixed3(ttft_s * 1000.0),
        b',"duration_ms":', fixed3(duration_s * 1000.0),
        b',"overhead_ms":', b"null" if overhead_s is None else fixed3(overhead_s * 1000.0),
        b',"prompt_tokens":', b"null" if prompt_tokens is None else str(prompt_tokens).encode(),
        b',"completion_tokens":', b"null" if completion_tokens is None else str(completion_tokens).encode(),
        parts[2],
    ))


_FRAGMENTS: Final[dict[tuple, tuple[bytes, bytes, bytes]]] = {}


def _fragments(fixed: tuple) -> tuple[bytes, bytes, bytes]:
    endpoint, deployment, backend, route, stream, key, worker = fixed
    if len(_FRAGMENTS) >= _FIXED_MAX:  # (bounded: keys and deployments are configured, but be safe)
        _FRAGMENTS.clear()
    dumps = orjson.dumps
    parts = _FRAGMENTS[fixed] = (
        b',"endpoint":%s,"deployment":%s,"backend":%s,"route":%s,"status":'
        % (dumps(endpoint), dumps(deployment), dumps(backend), dumps(route)),
        b',"stream":%s,"ttft_ms":' % dumps(stream),
        b',"key":%s,"worker":%d}\n' % (dumps(key), worker),
    )
    return parts


_FIELDS_SIZE: Final = 320  # bytes a line of fields is counted as toward a batch before it is formatted


class LineWriter(logging.Handler):
    """The access log's own handler: each record's message as one line on a file descriptor
    (stdout, or a file opened for appending).

    Lines are batched into writes ending on a line boundary, of at most PIPE_BUF bytes to a pipe or
    a terminal, so that lines of several workers sharing one pipe never interleave (a regular file
    takes 64 KiB at a time: Linux writes each write to it whole, and fewer writes cost less); a
    batch goes out when it is full or within 0.1 s of its first line (or at exit). `fields()` is
    the fast path AccessLog uses while this is the logger's only handler: no LogRecord, no
    per-line system call, and the line formatted with its batch (`_format`)."""

    BATCH = 4096  # PIPE_BUF on Linux: a write this size to a pipe is atomic
    FILE_BATCH = 65536
    DELAY_S = 0.1

    def __init__(self, path: str | None = None) -> None:
        super().__init__()
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else 1
        try:
            if stat.S_ISREG(os.fstat(self.fd).st_mode):
                self.BATCH = self.FILE_BATCH
        except OSError:
            pass
        self.pending: list[bytes | Fields] = []  # lines, or fields of lines (`_format`)
        self.size = 0
        self.timer_loop: asyncio.AbstractEventLoop | None = None  # the loop whose flush timer is pending
        self.timer_thread = 0  # the thread that loop runs in
        self.mutex = threading.Lock()  # several proxies (threads) may share it in one process
        atexit.register(self.flush)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.line(record.getMessage().encode() + b"\n")
        except Exception:
            self.handleError(record)

    def line(self, data: bytes) -> None:
        self._add(data, len(data))

    def fields(self, fields: Fields) -> None:
        """An access-log line, formatted when its batch is written."""
        self._add(fields, _FIELDS_SIZE)

    def _add(self, entry: bytes | Fields, size: int) -> None:
        with self.mutex:
            self.pending.append(entry)
            self.size += size
            if self.size < self.BATCH - 512:
                # A timer of this thread's running loop is pending: it writes this line too. (Asked
                # without asyncio.get_running_loop(), a getpid() system call on Python < 3.12: a
                # thread runs one loop at a time, so a running timer loop of this thread is it.)
                timer = self.timer_loop
                if timer is not None and self.timer_thread == threading.get_ident() and timer.is_running():
                    return
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # no event loop in this thread: write now
                    loop = None
                if loop is not None:
                    # one timer per loop at a time, never cancelled (a loop's timer is not another
                    # thread's to cancel): when it fires it writes what is pending, if anything
                    if timer is not loop:
                        self.timer_loop, self.timer_thread = loop, threading.get_ident()
                        loop.call_later(self.DELAY_S, self._timed, loop)
                    return
        self.flush()

    def _timed(self, loop: asyncio.AbstractEventLoop) -> None:
        with self.mutex:
            if self.timer_loop is loop:
                self.timer_loop = None
        self.flush()

    def flush(self) -> None:
        with self.mutex:
            pending, self.pending, self.size = self.pending, [], 0
        lines: list[bytes] = []
        for entry in pending:
            if isinstance(entry, bytes):
                lines.append(entry)
            else:
                try:
                    lines.append(_format(entry))
                except Exception:  # (one bad field loses its line, not the batch)
                    logging.getLogger("vllm_proxy").debug("access-log line dropped", exc_info=True)
        start = size = 0
        for i, data in enumerate(lines):  # writes of at most BATCH bytes, each ending on a line
            if size and size + len(data) > self.BATCH:
                self._write(b"".join(lines[start:i]))
                start, size = i, 0
            size += len(data)
        if size:
            self._write(b"".join(lines[start:]))

    def _write(self, data: bytes) -> None:
        # (no `view[os.write(...):]`: compiled, mypyc evaluates a slice's bound twice: two writes)
        done = os.write(self.fd, data)
        while done < len(data):  # a short write (a full pipe): the rest
            done += os.write(self.fd, data[done:])


def install_handler(path: str | None) -> LineWriter | None:
    """Give the access logger its own line handler, unless one is configured already (by an
    embedding application or an earlier proxy in this process); returns the handler in use if
    it is ours."""
    if not log.handlers:
        log.addHandler(LineWriter(path))
        log.propagate = False  # the line is the JSON; no "time level name:" prefix from the root handler
    found = log.handlers[0]
    return found if isinstance(found, LineWriter) else None


class AccessLog:
    """Built only when `logging.access_log` is on; `Runtime.access` is None otherwise."""

    def __init__(self, config: LoggingConfig) -> None:
        self.level = LEVELS[config.level]
        self.sample = config.sample
        self.writer = install_handler(config.file)
        self.worker = worker_id()
        self._enabled: dict[int, bool] = getattr(log, "_cache", {})  # level -> enabled (CPython 3.7+)

    def wanted(self) -> bool:
        """Whether this request gets a line (level enabled, and drawn by the sampling)."""
        # (Logger.isEnabledFor reads its answer from the logger's cache, which logging clears on
        # any level change: read there first, without the interpreted call, as it does)
        enabled = self._enabled.get(self.level)
        if enabled is None or log.disabled:
            enabled = log.isEnabledFor(self.level)
        if not enabled:
            return False
        return self.sample >= 1.0 or random.random() < self.sample

    def write(
        self, request_id: str, endpoint: str, deployment: str, backend: str, route: str | None, status: str,
        stream: bool, duration_s: float, ttft_s: float | None = None, overhead_s: float | None = None,
        tokens: tuple[int | None, int | None] = (None, None), key: str | None = None,
    ) -> None:
        fields: Fields = (time.time(), request_id, endpoint, deployment, backend, route, status, stream, duration_s,
                          ttft_s, overhead_s, tokens, key, self.worker)
        handlers = log.handlers
        if len(handlers) == 1 and handlers[0] is self.writer and not log.filters and not log.disabled:
            self.writer.fields(fields)  # our handler alone: no LogRecord, the line formatted with its batch
        else:  # makeRecord + handle: what log.log() does, without its stack walk for the caller
            log.handle(log.makeRecord(LOGGER, self.level, "", 0, _format(fields)[:-1].decode(), (), None))
