"""Child processes of a benchmark (replicas, proxies, peer routers): each in its own session so
stopping it stops its workers too, with its output in a log file for error messages."""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
            except ProcessLookupError:
                pass

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def spawn(name: str, cmd: list[str], logs: Path, env: dict | None = None, cwd: Path = ROOT) -> Proc:
    log = logs / f"{name}.log"
    popen = subprocess.Popen(cmd, cwd=cwd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, **(env or {})})
    return Proc(name, popen, log)


def wait_ready(proc: Proc, url: str, timeout: float = 30.0) -> None:
    """Until `url` answers 200; raises with the process's last output if it dies or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n{proc.tail()}")
