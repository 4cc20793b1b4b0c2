"""One logging setup for `vllm-proxy` and every worker of `serve --workers N`.

Workers are spawned processes: they inherit no handler and no level from the supervisor, so
without this their INFO lines (and the access log, whose logger is a child of the root) were lost
and their warnings came out bare through logging's last-resort handler. The supervisor records
the format and level in the environment; each worker configures itself the same way, with its
worker id in every line.

Every worker watches the same fleet and the same policy file, so what they observe in common
(backend up/down, scrape and Redis state, config reloads, key setup) would be logged N times; only worker 0
(the "leader", also the only one counting reloads in the metrics) logs those loggers.
"""
from __future__ import annotations

import logging
import os
import sys
import time

import orjson

LEVEL_ENV = "VLLM_PROXY_LOG_LEVEL"
FORMAT_ENV = "VLLM_PROXY_LOG_FORMAT"
WORKER_ENV = "VLLM_PROXY_WORKER"
FORMATS = ("text", "json")

# Loggers of what every worker observes alike: logged by the leader only.
FLEET_LOGGERS = frozenset(
    ("vllm_proxy.health", "vllm_proxy.reload", "vllm_proxy.scrape", "vllm_proxy.shared", "vllm_proxy.runtime",
     "vllm_proxy.auth")
)


def worker_id() -> int:
    """This process's worker number under `serve --workers N` (0 … N-1); 0 for a single process."""
    try:
        return int(os.environ.get(WORKER_ENV, "0"))
    except ValueError:
        return 0


def is_leader() -> bool:
    """True in the one process that logs and counts fleet-wide observations."""
    return worker_id() == 0


class _WorkerFilter(logging.Filter):
    """Tags each record with the process's role, and drops duplicated fleet lines off the leader."""

    def __init__(self, role: str, leader: bool) -> None:
        super().__init__()
        self.role = role
        self.leader = leader

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.role
        return self.leader or record.name not in FLEET_LOGGERS


class _TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s [%(worker)s] %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + ".%03dZ" % record.msecs


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "level": record.levelname, "worker": record.worker,  # type: ignore[attr-defined]
                "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


_CHATTY = ("httpx", "httpcore")


def configure(level: str = "info", fmt: str = "text", role: str | None = None) -> None:
    """Install the handler on the root logger (replacing any), and remember level and format in
    the environment for worker processes started later. `role`: how lines name this process
    (`main`, `supervisor`, `worker-1`…); by default `worker-<id>` in a worker, else `main`."""
    os.environ[LEVEL_ENV] = level
    os.environ[FORMAT_ENV] = fmt
    if role is None:
        role = f"worker-{worker_id()}" if WORKER_ENV in os.environ else "main"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    handler.addFilter(_WorkerFilter(role, role == "supervisor" or is_leader()))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # the control plane's client logs every poll and scrape at INFO (a line per replica every few
    # seconds): request detail, shown at debug only
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if level.lower() == "debug" else logging.WARNING)


def configure_worker(index: int) -> None:
    """In a freshly spawned worker: the supervisor's setup, naming this worker."""
    os.environ[WORKER_ENV] = str(index)
    configure(os.environ.get(LEVEL_ENV, "info"), os.environ.get(FORMAT_ENV, "text"))
