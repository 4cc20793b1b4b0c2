"""The structured access log: one JSON line per request on logger `vllm_proxy.access`.

Fields: ts, request_id, endpoint, deployment, backend, route (the routing reason), status,
stream, ttft_ms, duration_ms, overhead_ms, prompt_tokens, completion_tokens (when the upstream
reported usage). Never prompt or completion content, never keys or headers.

Cost: with `logging.access_log: false` the request path makes one `is None` test. When on,
a request that the logger level or the sampling drops costs a level check and a random draw;
a written line costs one orjson.dumps and one LogRecord (no caller lookup). Token counts come
from a bounded regex search at the `"usage"` key of the body (non-streaming) or of the last
data chunk (streaming, when the client asked for `stream_options.include_usage`); nothing else
of the response is looked at.
"""
from __future__ import annotations

import logging
import random
import re
import sys
import time

import orjson

from proxy.config import LoggingConfig

LOGGER = "vllm_proxy.access"
log = logging.getLogger(LOGGER)
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}

_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_USAGE_WINDOW = 1024  # bytes after `"usage":{` that may hold the counts


def usage_tokens(buf: bytes | None) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of the last `"usage": {...}` object in `buf`."""
    if not buf:
        return None, None
    at = buf.rfind(b'"usage"')
    if at < 0 or _USAGE.match(buf, at) is None:
        return None, None
    end = at + _USAGE_WINDOW
    prompt = _PROMPT.search(buf, at, end)
    completion = _COMPLETION.search(buf, at, end)
    return (int(prompt.group(1)) if prompt else None), (int(completion.group(1)) if completion else None)


class _StdoutHandler(logging.Handler):
    """Writes each record's message as one line to the current sys.stdout (looked up per line,
    so a replaced stdout, e.g. under pytest, is followed)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout
            stream.write(record.getMessage() + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def install_handler(path: str | None) -> None:
    """Give the access logger its own plain-line handler, unless one is configured already
    (by an embedding application or an earlier proxy in this process)."""
    if log.handlers:
        return
    if path:
        handler: logging.Handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = _StdoutHandler()
    log.addHandler(handler)
    log.propagate = False  # the line is the JSON; no "time level name:" prefix from the root handler


class AccessLog:
    """Built only when `logging.access_log` is on; `Runtime.access` is None otherwise."""

    def __init__(self, config: LoggingConfig) -> None:
        self.level = LEVELS[config.level]
        self.sample = config.sample
        install_handler(config.file)

    def wanted(self) -> bool:
        """Whether this request gets a line (level enabled, and drawn by the sampling)."""
        if not log.isEnabledFor(self.level):
            return False
        return self.sample >= 1.0 or random.random() < self.sample

    def write(
        self, request_id: str, endpoint: str, deployment: str, backend: str, route: str | None, status: str,
        stream: bool, duration_s: float, ttft_s: float | None = None, overhead_s: float | None = None,
        usage_from: bytes | None = None,
    ) -> None:
        prompt_tokens, completion_tokens = usage_tokens(usage_from)
        line = orjson.dumps({
            "ts": round(time.time(), 3),
            "request_id": request_id,
            "endpoint": endpoint,
            "deployment": deployment,
            "backend": backend,
            "route": route,
            "status": int(status),
            "stream": stream,
            "ttft_ms": None if ttft_s is None else round(ttft_s * 1000.0, 3),
            "duration_ms": round(duration_s * 1000.0, 3),
            "overhead_ms": None if overhead_s is None else round(overhead_s * 1000.0, 3),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
        }).decode()
        # makeRecord + handle: the same record log.log() builds, without its stack walk for the caller
        log.handle(log.makeRecord(LOGGER, self.level, "", 0, line, None, None))
