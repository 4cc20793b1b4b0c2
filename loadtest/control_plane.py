"""Control-plane cost: one discovery round (GET /v1/models) plus one scrape round (GET /metrics)
over N replicas, as the proxy runs them (proxy/health.py, proxy/scrape.py, the Upstream's
control-plane client). Prints CPU and wall time per round and CPU per request.

The replicas are raw asyncio servers in a child process (keep-alive, a vLLM-sized /metrics).
Only `proxy.*` is imported, so the same file measures another tree's client, e.g. main's:

    python -m loadtest.control_plane                         # 64 replicas, 60 rounds
    cd /work/main && .venv/bin/python /path/to/loadtest/control_plane.py --replicas 64
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import time

MODELS = b'{"object":"list","data":[{"id":"m","object":"model","created":0,"owned_by":"vllm","root":"m","parent":null}]}'


def _metrics(kib: int) -> bytes:
    lines = ['vllm:num_requests_waiting{model_name="m"} 3', 'vllm:kv_cache_usage_perc{model_name="m"} 0.25',
             'vllm:cache_config_info{block_size="16",num_gpu_blocks="8192",model_name="m"} 1.0']
    i = 0
    while sum(len(line) + 1 for line in lines) < kib * 1024:  # histogram buckets: most of a real exposition
        lines.append(f'vllm:e2e_request_latency_seconds_bucket{{le="{i}",model_name="m"}} {i * 7}')
        i += 1
    return ("\n".join(lines) + "\n").encode()


def _response(ctype: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (ctype, len(body), body)


class Replica(asyncio.Protocol):
    routes: dict[bytes, bytes] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            self.transport.write(self.routes.get(path, b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"))


def _serve(socks: list[socket.socket], kib: int) -> None:
    Replica.routes = {b"/v1/models": _response(b"application/json", MODELS),
                      b"/metrics": _response(b"text/plain; version=0.0.4", _metrics(kib))}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(Replica, sock=s) for s in socks]
        await asyncio.gather(*(s.serve_forever() for s in servers))

    _loop_run(main())


def _loop_run(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


async def measure(ports: list[int], rounds: int) -> dict:
    from proxy.config import BackendConfig, DiscoveryConfig, ServerConfig
    from proxy.forward import Upstream
    from proxy.health import Discovery
    from proxy.metrics import Metrics
    from proxy.routing.backends import Backend
    from proxy.scrape import BackendScraper

    upstream = Upstream(ServerConfig())
    await upstream.open()
    client = type(upstream.session).__module__.split(".")[0]
    backends = [Backend(BackendConfig(name=f"r{i}", url=f"http://127.0.0.1:{p}")) for i, p in enumerate(ports)]
    config = DiscoveryConfig(interval_s=1.0, timeout_s=5.0)
    discovery = Discovery(lambda: upstream.session, backends, config, lambda: None)
    scraper = BackendScraper(lambda: upstream.session, backends, config, Metrics(enabled=True))
    cpu, wall = [], []
    try:
        for i in range(rounds + 5):
            c0, w0 = time.process_time(), time.perf_counter()
            await discovery.poll_all()
            await scraper.scrape_all()
            if i >= 5:  # the first rounds open the connections
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
        assert all(b.healthy for b in backends), "a replica did not answer"
    finally:
        await upstream.close()
    return {"cpu": cpu, "wall": wall, "client": client}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--metrics-kib", type=int, default=32, help="size of each replica's /metrics answer")
    args = ap.parse_args()
    socks = []
    for _ in range(args.replicas):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(128)
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    child = multiprocessing.get_context("fork").Process(target=_serve, args=(socks, args.metrics_kib), daemon=True)
    child.start()
    try:
        out: dict = {}

        async def run() -> None:
            out.update(await measure(ports, args.rounds))

        _loop_run(run())
    finally:
        child.terminate()
        child.join()
    import proxy

    cpu_ms = statistics.median(out["cpu"]) * 1000
    wall_ms = statistics.median(out["wall"]) * 1000
    p90 = sorted(out["wall"])[int(0.9 * len(out["wall"]))] * 1000
    print(f"tree: {os.path.dirname(os.path.dirname(proxy.__file__))} (control-plane client: {out['client']})")
    print(f"{args.replicas} replicas, {args.rounds} rounds of poll + scrape ({args.metrics_kib} KiB /metrics): "
          f"CPU {cpu_ms:.1f} ms/round ({cpu_ms * 1000 / (2 * args.replicas):.0f} µs/request), "
          f"wall median {wall_ms:.1f} ms, p90 {p90:.1f} ms")


if __name__ == "__main__":
    main()
