"""`serve --workers N`: N proxy processes, each listening on its own SO_REUSEPORT socket.

uvicorn's own supervisor hands every worker one shared listening socket, and whichever worker
wakes first accepts a burst of connections: with a few long-lived keep-alive clients one worker
ran at 100 % CPU while the other idled at ~50 % (loadtest/overhead.py, 2 workers). With a socket
per worker the kernel spreads connections over them by hash. The supervisor is small: it starts
the workers, restarts one that dies, forwards SIGHUP (each worker reloads its config file) and
on SIGTERM/SIGINT lets every worker drain, then exits 0.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import time

log = logging.getLogger("vllm_proxy")

_QUICK_DEATH_S = 10.0  # a worker dying this soon after its start counts towards giving up
_GIVE_UP_AFTER = 3  # consecutive quick deaths


def reuseport_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
        sock.set_inheritable(True)
    return sock


def _worker(options: dict, host: str, port: int, index: int = 0) -> None:
    """One worker process: its own socket, uvicorn's server (which drains on SIGTERM)."""
    import uvicorn

    from proxy.drain import DrainingServer
    from proxy.logsetup import configure_worker

    configure_worker(index)  # a spawned process inherits no logging setup (proxy/logsetup.py)
    _die_with_parent()
    # SIGHUP stays ignored (inherited, see serve()) until the config watcher handles it.
    config = uvicorn.Config("proxy.cli:app_from_env", factory=True, host=host, port=port, **options)
    DrainingServer(config).run(sockets=[reuseport_socket(host, port)])


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker if the supervisor dies (SIGKILL, OOM), so no orphan keeps serving."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the supervisor died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def serve(options: dict, host: str, port: int, workers: int) -> int:
    """Run `workers` worker processes until SIGTERM/SIGINT; returns the exit status.

    Signal handlers only record what arrived; the loop acts on it. First SIGTERM/SIGINT: every
    worker drains (uvicorn's graceful shutdown); a second one, or the drain deadline passing,
    kills them. SIGHUP is passed to every worker (a reload; one arriving in the instant a worker
    is being started is dropped, and the workers' file watchers still see a changed file)."""
    stops = 0
    hups = 0

    def on_stop(signum: int, frame: object) -> None:
        nonlocal stops
        stops += 1

    def on_hup(signum: int, frame: object) -> None:
        nonlocal hups
        hups += 1

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_hup)
    try:
        # Claims the port (bound, never listening: it gets no connections) so a port held by a
        # socket without SO_REUSEPORT fails here, once, instead of in every worker.
        guard = reuseport_socket(host, port, listen=False)
    except OSError as exc:
        print(f"vllm-proxy: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    ctx = multiprocessing.get_context("spawn")
    drain_s = float(options.get("timeout_graceful_shutdown") or 120.0) + 10.0

    def start(index: int) -> tuple[multiprocessing.Process, float]:
        proc = ctx.Process(target=_worker, args=(options, host, port, index), daemon=False)
        # The child inherits "ignore SIGHUP" across exec (a handler would reset to the default,
        # which kills it): a SIGHUP passed on while it imports must not end it.
        previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGHUP, previous)
        return proc, time.monotonic()

    def send(sig: int) -> None:
        for proc, _ in procs:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, sig)  # type: ignore[arg-type]
                except ProcessLookupError:
                    pass

    procs: list[tuple[multiprocessing.Process, float]] = []
    status = 0
    quick_deaths = 0
    handled_stops = handled_hups = 0
    stop_deadline = None
    try:
        while len(procs) < workers and not stops:
            procs.append(start(len(procs)))
        while True:
            if stops != handled_stops:
                handled_stops = stops
                if stop_deadline is None:
                    stop_deadline = time.monotonic() + drain_s
                    send(signal.SIGTERM)
                else:
                    send(signal.SIGKILL)  # asked twice: stop now
            if stop_deadline is not None:
                if not any(proc.is_alive() for proc, _ in procs):
                    break
                if time.monotonic() > stop_deadline:
                    print("vllm-proxy: workers still draining at the deadline; killing them", file=sys.stderr)
                    send(signal.SIGKILL)
                    stop_deadline = time.monotonic() + 5.0
            elif hups != handled_hups:
                handled_hups = hups
                send(signal.SIGHUP)
            if stop_deadline is None:
                for i, (proc, started) in enumerate(procs):
                    if proc.is_alive():
                        continue
                    quick_deaths = quick_deaths + 1 if time.monotonic() - started < _QUICK_DEATH_S else 0
                    if quick_deaths >= _GIVE_UP_AFTER:
                        print(f"vllm-proxy: workers keep exiting at startup (last exit code {proc.exitcode}); "
                              "giving up", file=sys.stderr)
                        status = 1
                        stops += 1
                        break
                    log.warning("worker-%d (pid %s) exited with code %s; starting a new one", i, proc.pid, proc.exitcode)
                    procs[i] = start(i)
            time.sleep(0.1)
        for proc, _ in procs:
            proc.join(5.0)
    finally:
        guard.close()
    return status
