"""Hostile clients against a live proxy: does it stay responsive and bounded?

Holds `--conns` connections open against the proxy (half idle, half dripping a request head one
byte per second; each one the proxy closes is reopened at once), while `--big` clients send
2 MiB request headers back to back. A separate probe process meanwhile sends `GET /health` and a
normal chat completion (each on its own keep-alive connection) every 20 ms and reports latency
percentiles; the proxy's RSS is sampled every second. A first phase without the attack gives the
baseline. The proxy (`vllm-proxy serve`) forwards to loadtest.fast_backend.

    python -m loadtest.hostile                         # 2000 conns + 2 big-header clients, 60 s
    python -m loadtest.hostile --conns 500 --duration 20 --header-timeout 5
    python -m loadtest.hostile --conns 5000 --proxy-fd-limit 4096   # more sockets than the proxy has fds
    python -m loadtest.hostile --conns 0 --big 10 --header-mib 64   # the review's 10 x 64 MiB headers
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path

from loadtest.overhead import free_port
from loadtest.procs import spawn, wait_ready

HOST = "127.0.0.1"
CHAT = (b'{"model":"bench-model","messages":[{"role":"user","content":"hello"}],"max_tokens":4}')


def raise_fd_limit(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard == resource.RLIM_INFINITY else min(hard, max(soft, need))
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the probe (its own process, so the attack's event loop does not inflate its latencies) ------

async def _probe(port: int, seconds: float, out) -> None:
    async def one(path: bytes, body: bytes | None) -> list[float]:
        if body is None:
            req = b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path
        else:
            req = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
                path, len(body), body)

        async def exchange(reader, writer) -> bool:
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            return head.startswith(b"HTTP/1.1 200")

        times: list[float] = []
        conn = None
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:  # a failure (refused, reset, 5 s without an answer) counts as failed, then reconnect
                if conn is None:
                    conn = await asyncio.wait_for(asyncio.open_connection(HOST, port), 5)
                good = await asyncio.wait_for(exchange(*conn), 5)
                times.append(time.perf_counter() - t0 if good else float("inf"))
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, IndexError, ValueError):
                times.append(float("inf"))
                if conn is not None:
                    conn[1].close()
                conn = None
            await asyncio.sleep(0.02)
        if conn is not None:
            conn[1].close()
        return times

    health, chat = await asyncio.gather(one(b"/health", None), one(b"/v1/chat/completions", CHAT))
    out.put({"health": health, "chat": chat})


def probe(port: int, seconds: float, out) -> None:
    asyncio.run(_probe(port, seconds, out))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


# -- the attack ------------------------------------------------------------------------------------

class Attack:
    def __init__(self, port: int, conns: int, big: int, header_mib: float) -> None:
        self.port, self.conns, self.big = port, conns, big
        self.header_bytes = int(header_mib * (1 << 20))
        self.open = 0
        self.reopened = 0
        self.refused = {}  # status line -> count, for the big-header clients
        self.stop = False

    async def idle(self, drip: bool) -> None:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 10_000
        while not self.stop:
            try:
                reader, writer = await asyncio.open_connection(HOST, self.port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            self.open += 1
            try:
                if drip:
                    for i in range(len(head)):
                        if self.stop or reader.at_eof():
                            break
                        writer.write(head[i:i + 1])
                        await asyncio.sleep(1.0)
                        if reader._buffer or reader.at_eof():  # the proxy answered (408) or closed
                            break
                else:
                    await reader.read()  # until the proxy closes it
            except (ConnectionError, OSError):
                pass
            finally:
                self.open -= 1
                writer.close()
            self.reopened += 1

    async def big_headers(self) -> None:
        req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * self.header_bytes +
               b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(CHAT), CHAT))
        while not self.stop:
            try:
                reader, writer = await asyncio.open_connection(HOST, self.port)
                writer.write(req)
                try:
                    await writer.drain()
                except ConnectionError:
                    pass
                answer = await reader.read()
                status = answer.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed)"
                writer.close()
            except (ConnectionError, OSError) as exc:
                status = type(exc).__name__
            self.refused[status] = self.refused.get(status, 0) + 1

    async def run(self, seconds: float) -> None:
        tasks = [asyncio.create_task(self.idle(drip=i % 2 == 1)) for i in range(self.conns)]
        tasks += [asyncio.create_task(self.big_headers()) for _ in range(self.big)]
        await asyncio.sleep(seconds)
        self.stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conns", type=int, default=2000, help="idle + slow-drip connections held open")
    ap.add_argument("--big", type=int, default=2, help="clients sending big headers back to back")
    ap.add_argument("--header-mib", type=float, default=2.0, help="size of their header")
    ap.add_argument("--proxy-fd-limit", type=int, default=None, help="run the proxy with this RLIMIT_NOFILE")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of attack")
    ap.add_argument("--baseline", type=float, default=10.0, help="seconds of probing before the attack")
    ap.add_argument("--header-timeout", type=float, default=None, help="server.header_timeout_s (default: the config default)")
    args = ap.parse_args()

    limit = raise_fd_limit(2 * args.conns + 1000)  # ours and, inherited, the proxy's
    if limit < args.conns + 200:
        sys.exit(f"file descriptor limit {limit} is too low for {args.conns} connections")
    tmp = Path(tempfile.mkdtemp(prefix="hostile-"))
    backend_port, port = free_port(), free_port()
    backend = spawn("backend", [sys.executable, "-m", "loadtest.fast_backend", "--port", str(backend_port)], tmp)
    server = f"{{host: {HOST}, port: {port}" + (f", header_timeout_s: {args.header_timeout}" if args.header_timeout else "") + "}"
    (tmp / "proxy.yaml").write_text(f"server: {server}\nbackends:\n"
                                    f'  - {{name: b0, url: "http://{HOST}:{backend_port}", models: [bench-model]}}\n'
                                    "routing: {policy: least_loaded}\n")
    exe = Path(sys.executable).with_name("vllm-proxy")
    cmd = [str(exe), "serve", "--config", str(tmp / "proxy.yaml")]
    if args.proxy_fd_limit:
        cmd = ["sh", "-c", f'ulimit -n {args.proxy_fd_limit} && exec "$0" "$@"', *cmd]
    proxy = spawn("proxy", cmd, tmp)
    try:
        wait_ready(backend, f"http://{HOST}:{backend_port}/health")
        wait_ready(proxy, f"http://{HOST}:{port}/ready")
        pid = proxy.popen.pid
        results = {}
        for phase, seconds, attack in (("baseline", args.baseline, None),
                                       ("attack", args.duration, Attack(port, args.conns, args.big, args.header_mib))):
            queue: multiprocessing.Queue = multiprocessing.Queue()
            prober = multiprocessing.Process(target=probe, args=(port, seconds, queue))
            rss = [rss_mib(pid)]
            prober.start()

            async def sample() -> None:
                while prober.is_alive():
                    rss.append(rss_mib(pid))
                    await asyncio.sleep(1.0)

            async def phase_run() -> None:
                jobs = [sample()] + ([attack.run(seconds)] if attack else [])
                await asyncio.gather(*jobs)

            asyncio.run(phase_run())
            got = queue.get(timeout=60)
            prober.join()
            results[phase] = (got, rss, attack)
        print(f"proxy pid {pid} (fd limit {args.proxy_fd_limit or limit}), {args.conns} idle/slow-drip connections + "
              f"{args.big} clients sending {args.header_mib:g} MiB headers, {args.duration:.0f} s "
              "(machine shared: numbers are indicative)")
        for phase, (got, rss, attack) in results.items():
            for name in ("health", "chat"):
                t = got[name]
                failed = sum(1 for x in t if x == float("inf"))
                t = [x for x in t if x != float("inf")]
                print(f"  {phase:8s} {name:6s} n={len(t):5d} p50={pct(t, .5):6.2f} ms p99={pct(t, .99):6.2f} ms "
                      f"max={pct(t, 1.0):7.2f} ms failed={failed}")
            print(f"  {phase:8s} proxy RSS MiB: start {rss[0]:.0f}, max {max(rss):.0f}, end {rss[-1]:.0f}")
            if attack is not None:
                print(f"  {phase:8s} attack: connections reopened after the proxy closed them: {attack.reopened}; "
                      f"big-header answers: {attack.refused}")
    finally:
        proxy.stop()
        backend.stop()


if __name__ == "__main__":
    main()
