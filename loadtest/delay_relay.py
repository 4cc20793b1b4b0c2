"""A TCP relay that delays every byte by a fixed time in each direction: a slow Redis (or any
slow peer) for tests and benchmarks, without touching the server itself.

Each direction keeps its bytes in order and delivers every chunk `delay_s` after it arrived, so
a request/response costs 2 x delay plus the server's own time, however many are in flight.

    python -m loadtest.delay_relay --target 127.0.0.1:6390 --delay-ms 100 [--port P]

In a test: `with DelayRelay("127.0.0.1", redis_port, 0.1) as relay: ... relay.port ...`.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import threading


class DelayRelay:
    """Listens on a free loopback port (or `port`) and relays to (host, port) in a thread of its own."""

    def __init__(self, host: str, target_port: int, delay_s: float, port: int = 0) -> None:
        self.target = (host, target_port)
        self.delay = delay_s
        self.port = port
        self.connections = 0  # accepted so far
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # -- relay ----------------------------------------------------------------------------------
    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = loop.create_task(deliver())
        try:
            while True:
                data = await reader.read(65536)
                queue.put_nowait((loop.time() + self.delay, data or None))
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()
            writer.close()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        self._writers.update((client_writer, server_writer))
        try:
            await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer),
                                 return_exceptions=True)
        except asyncio.CancelledError:  # the relay is stopping
            pass
        finally:
            self._writers.discard(client_writer)
            self._writers.discard(server_writer)

    async def _serve(self, ready: threading.Event) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        async with self._server:
            await self._server.serve_forever()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "DelayRelay":
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        loop = self._loop

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve(ready))
            except asyncio.CancelledError:
                pass
            finally:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name="delay-relay", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("delay relay did not start")
        return self

    def sever(self) -> None:
        """Cut every relayed connection (new ones are still accepted)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: [w.close() for w in list(self._writers)])

    def stop(self) -> None:
        if self._loop is None or self._server is None:
            return
        loop, server = self._loop, self._server

        def close() -> None:
            server.close()
            for w in list(self._writers):
                w.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()

        loop.call_soon_threadsafe(close)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> "DelayRelay":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="host:port to relay to")
    ap.add_argument("--delay-ms", type=float, default=100.0, help="added in each direction")
    ap.add_argument("--port", type=int, default=0, help="listen port (default: free)")
    args = ap.parse_args()
    host, _, port = args.target.rpartition(":")
    relay = DelayRelay(host or "127.0.0.1", int(port), args.delay_ms / 1000, args.port).start()
    print(f"relaying 127.0.0.1:{relay.port} -> {args.target} with {args.delay_ms:g} ms each way", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        relay.stop()


if __name__ == "__main__":
    main()
