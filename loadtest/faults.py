"""Fault benchmark: what replica faults cost clients of the proxy, default configuration.

Four simulated replicas (`vllm-proxy sim`, separate processes, realistic pacing: 20 ms per token)
behind one `vllm-proxy serve` with the default settings (no short first-byte timeout; the drain
deadline is shortened for the last scenario only, as noted). Load throughout: `--clients`
threads sending short requests, every other one streaming, each a new request. Scenarios:

- hung: one replica SIGSTOPped while 8 long streams run and the load goes on, SIGCONTed later;
- long prefill: a request whose first token takes 20 s (the simulator's `long_prefill` fault),
  non-streaming with nothing else running (its replica is silent and gets probed), then streaming
  under the load;
- poison: a request that hangs on any replica (`poison` fault; a deployment with a 5 s first-byte
  timeout, so the run is short);
- flapping: one replica SIGSTOPped and SIGCONTed every 2 s for 20 s;
- killed: one replica SIGKILLed, then started again;
- rolling restart: every replica in turn SIGTERMed and started again on its port;
- proxy SIGTERM during streams (drain deadline 10 s for the run).

Per scenario: new requests sent / failed, worst latency, streams on the faulty replica and when
each ended (seconds after the fault) and how (SSE error event or [DONE]), when the replica left
and re-entered /ready's healthy list.

    python -m loadtest.faults                 # all scenarios, ~3 minutes
    python -m loadtest.faults --only hung poison
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from loadtest.procs import Proc, spawn, wait_ready

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHAT = "/v1/chat/completions"
CLIENT_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Fleet:
    def __init__(self, tmp: Path, drain_s: float | None = None) -> None:
        self.tmp = tmp
        self.ports = [free_port() for _ in range(4)]
        self.sims: list[Proc] = [self._sim(i) for i in range(4)]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        server = {"port": self.port} | ({"drain_timeout_s": drain_s} if drain_s else {})
        config = {
            "server": server,
            "backends": [{"name": f"gpu-{i}", "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(self.ports)],
            "deployments": [{"name": MODEL, "model": MODEL},
                            {"name": "hasty", "model": MODEL, "timeouts": {"first_byte": 5}}],
        }
        path = tmp / "policy.json"  # JSON is YAML
        path.write_text(json.dumps(config))
        self.proxy = spawn("proxy", [sys.executable, "-m", "proxy", "serve", "--config", str(path)], tmp)
        for i, p in enumerate(self.ports):
            wait_ready(self.sims[i], f"http://127.0.0.1:{p}/health")
        wait_ready(self.proxy, self.url + "/ready")
        deadline = time.monotonic() + 30
        while len(self.healthy()) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)

    def _sim(self, i: int) -> Proc:
        return spawn(f"sim-{i}", [sys.executable, "-m", "proxy", "sim", "--port", str(self.ports[i]), "--model", MODEL,
                                  "--time-scale", "1", "--itl-ms", "20", "--prefill-ms-per-token", "0"], self.tmp)

    def restart(self, i: int) -> None:
        self.sims[i] = self._sim(i)
        wait_ready(self.sims[i], f"http://127.0.0.1:{self.ports[i]}/health")

    def signal(self, i: int, sig: int) -> None:
        os.killpg(self.sims[i].popen.pid, sig)

    def fault(self, i: int, **changes) -> None:
        httpx.post(f"http://127.0.0.1:{self.ports[i]}/sim/faults", json=changes).raise_for_status()

    def healthy(self) -> list[str]:
        try:
            return httpx.get(self.url + "/ready", timeout=5).json()["healthy_backends"]
        except (httpx.HTTPError, ValueError):
            return []

    def stop(self) -> None:
        for proc in [self.proxy, *self.sims]:
            try:
                os.killpg(proc.popen.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            proc.stop()


def body(content: str, stream: bool, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, **extra}


class Load:
    """Client threads sending new short requests back to back; records (ok, seconds, what, sent at).
    A stream already under way on a replica when it fails ends with an error event: `stop` counts
    requests sent after the fault (`since`) apart."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.results: list[tuple[bool, float, str, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, k: int) -> None:
        i = k
        with httpx.Client(timeout=CLIENT_TIMEOUT) as client:
            while not self._stop.is_set():
                stream = i % 2 == 0
                started = time.monotonic()
                try:
                    resp = client.post(self.url + CHAT, json=body(f"question {i}", stream))
                    ok = resp.status_code == 200 and ("[DONE]" in resp.text if stream else True)
                    what = str(resp.status_code)
                except httpx.HTTPError as exc:
                    ok, what = False, type(exc).__name__
                self.results.append((ok, time.monotonic() - started, what, started))
                i += 1000

    def stop(self, since: float = 0.0) -> dict:
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_TIMEOUT + 5)
        new = [r for r in self.results if r[3] >= since]
        failed = [w for ok, _, w, _ in new if not ok]
        report = {"requests": len(new), "failed": len(failed), "failures": sorted(set(failed)),
                  "worst_s": round(max((t for _, t, _, _ in new), default=0.0), 2)}
        if since:
            report["in_flight_at_fault_failed"] = sum(not ok for ok, _, _, at in self.results if at < since)
        return report


class Stream(threading.Thread):
    """A long stream (ignore_eos: runs max_tokens); records its replica, when and how it ended."""

    def __init__(self, url: str, i: int, max_tokens: int = 3000) -> None:
        super().__init__(daemon=True)
        self.url, self.payload = url, body(f"long story {i}", True, max_tokens, ignore_eos=True)
        self.backend: str | None = None
        self.first = threading.Event()
        self.ended_at = 0.0
        self.how = "open"
        self.start()

    def run(self) -> None:
        last = ""
        try:
            with httpx.stream("POST", self.url + CHAT, json=self.payload, timeout=CLIENT_TIMEOUT) as resp:
                self.backend = resp.headers.get("x-vllm-proxy-backend")
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        last = line[6:]
                        self.first.set()
            self.how = "[DONE]" if last == "[DONE]" else ("error event" if last.startswith('{"error"') else "cut")
        except httpx.HTTPError as exc:
            self.how = f"client error {type(exc).__name__}"
        self.ended_at = time.monotonic()
        self.first.set()


def wait_for(predicate, timeout: float = 60.0) -> float | None:
    """Seconds until `predicate()` held, or None."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return round(time.monotonic() - started, 2)
        time.sleep(0.05)
    return None


def stream_report(streams: list[Stream], on: str, since: float) -> list[dict]:
    return [{"ended_after_s": round(s.ended_at - since, 2) if s.ended_at else None, "how": s.how}
            for s in streams if s.backend == on]


def strike(fleet: Fleet, clients: int, i: int, sig: int) -> tuple[Load, float, float | None]:
    """Start the load, then signal replica `i`: (the load, when, seconds until it left /ready)."""
    load = Load(fleet.url, clients)
    time.sleep(2)
    fault_at = time.monotonic()
    fleet.signal(i, sig)
    return load, fault_at, wait_for(lambda: f"gpu-{i}" not in fleet.healthy())


def scenario_hung(fleet: Fleet, clients: int) -> dict:
    streams = [Stream(fleet.url, i) for i in range(8)]
    for s in streams:
        s.first.wait(60)
    load, fault_at, down = strike(fleet, clients, 1, signal.SIGSTOP)
    time.sleep(15)
    report = {"marked_down_after_s": down, "streams_on_hung": stream_report(streams, "gpu-1", fault_at)}
    fleet.signal(1, signal.SIGCONT)
    report["back_after_resume_s"] = wait_for(lambda: "gpu-1" in fleet.healthy())
    time.sleep(2)
    report["load_sent_after_fault"] = load.stop(fault_at)
    report["other_streams_still_running"] = sum(s.is_alive() for s in streams if s.backend != "gpu-1")
    for s in streams:
        s.join(0)
    return report


def scenario_long_prefill(fleet: Fleet, clients: int) -> dict:
    for i in range(4):
        fleet.fault(i, long_prefill="a very long document", long_prefill_ms=20000)
    dropped = threading.Event()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if len(fleet.healthy()) < 4:
                dropped.set()
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    results = {}
    load = None
    for stream in (False, True):  # alone on a silent fleet (probed, answering), then under load
        if stream:
            load = Load(fleet.url, clients)
        started = time.monotonic()
        resp = httpx.post(fleet.url + CHAT, json=body("a very long document", stream), timeout=CLIENT_TIMEOUT)
        ok = resp.status_code == 200 and ("[DONE]" in resp.text if stream else True)
        results["stream" if stream else "plain"] = {"ok": ok, "seconds": round(time.monotonic() - started, 2)}
    done.set()
    watcher.join()
    for i in range(4):
        fleet.fault(i, long_prefill="")
    return {"long_request": results, "a_replica_left_rotation": dropped.is_set(), "load": load.stop()}


def scenario_poison(fleet: Fleet, clients: int) -> dict:
    for i in range(4):
        fleet.fault(i, poison="n=100000")
    load = Load(fleet.url, clients)
    started = time.monotonic()
    resp = httpx.post(fleet.url + CHAT, json={**body("please n=100000", False), "model": "hasty"},
                      timeout=CLIENT_TIMEOUT)
    took = time.monotonic() - started
    error = resp.json().get("error", {})
    for i in range(4):
        fleet.fault(i, poison="")
    return {"status": resp.status_code, "seconds": round(took, 2), "message": error.get("message"),
            "healthy_after": len(fleet.healthy()), "load": load.stop()}


def scenario_flapping(fleet: Fleet, clients: int) -> dict:
    load = Load(fleet.url, clients)
    for _ in range(5):
        fleet.signal(2, signal.SIGSTOP)
        time.sleep(2)
        fleet.signal(2, signal.SIGCONT)
        time.sleep(2)
    back = wait_for(lambda: "gpu-2" in fleet.healthy())
    return {"back_after_last_resume_s": back, "load": load.stop()}


def scenario_killed(fleet: Fleet, clients: int) -> dict:
    load, fault_at, down = strike(fleet, clients, 3, signal.SIGKILL)
    time.sleep(5)
    fleet.restart(3)
    back = wait_for(lambda: "gpu-3" in fleet.healthy())
    return {"marked_down_after_s": down, "back_after_restart_s": back, "load_sent_after_fault": load.stop(fault_at)}


def scenario_rolling_restart(fleet: Fleet, clients: int) -> dict:
    load = Load(fleet.url, clients)
    backs = []
    for i in range(4):
        fleet.sims[i].stop()  # SIGTERM: uvicorn finishes what it runs
        wait_for(lambda: f"gpu-{i}" not in fleet.healthy(), timeout=30)
        fleet.restart(i)
        backs.append(wait_for(lambda: f"gpu-{i}" in fleet.healthy(), timeout=30))
    return {"back_after_restart_s": backs, "load": load.stop()}


def scenario_proxy_sigterm(fleet: Fleet, clients: int) -> dict:
    streams = [Stream(fleet.url, i) for i in range(6)] + [Stream(fleet.url, 100 + i, max_tokens=150) for i in range(2)]
    for s in streams:
        s.first.wait(60)
    sent = time.monotonic()
    fleet.proxy.popen.send_signal(signal.SIGTERM)
    answers = []  # /ready during the drain, polled until the proxy exits

    def poll() -> bool:
        try:
            answers.append(httpx.get(fleet.url + "/ready", timeout=5).status_code)
        except httpx.HTTPError as exc:
            answers.append(type(exc).__name__)
        return fleet.proxy.popen.poll() is not None

    wait_for(poll, timeout=60)
    code = fleet.proxy.popen.wait(60)
    ready = {str(a): answers.count(a) for a in dict.fromkeys(answers)}
    for s in streams:
        s.join(30)
    return {"ready_while_draining": ready, "exit_code": code, "exited_after_s": round(time.monotonic() - sent, 2),
            "streams": [{"ended_after_s": round(s.ended_at - sent, 2), "how": s.how} for s in streams]}


SCENARIOS = {"hung": scenario_hung, "long_prefill": scenario_long_prefill, "poison": scenario_poison,
             "flapping": scenario_flapping, "killed": scenario_killed, "rolling_restart": scenario_rolling_restart,
             "proxy_sigterm": scenario_proxy_sigterm}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    report = {}
    for name in args.only:
        with tempfile.TemporaryDirectory() as tmp:
            fleet = Fleet(Path(tmp), drain_s=10 if name == "proxy_sigterm" else None)
            try:
                report[name] = SCENARIOS[name](fleet, args.clients)
            finally:
                fleet.stop()
        print(f"{name}: {json.dumps(report[name])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
