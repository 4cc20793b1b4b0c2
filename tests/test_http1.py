"""The upstream client (proxy/http1.py) against a scripted, broken upstream.

Each case is something a real replica or an intermediary has done: interim 1xx answers, bytes past
the end of a response, impossible statuses, bodies delimited by the connection's end, a keep-alive
connection that dies after our request was written, an answer dripped a byte at a time, and bodies
too large to buffer. The upstream is a plain asyncio server that reads each request and plays the
next step of its script.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

import pytest

from proxy.http1 import Pool, UpstreamError

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: upstream\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"
BODY = b"{}"
WAIT = 10.0  # a generous bound on any step of a test: far beyond the timeouts under test


@dataclass
class Timeouts:
    connect: float = 5.0
    first_byte: float = 5.0
    idle: float = 5.0
    total: float = 30.0


Step = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


class Upstream:
    """Plays `script[n]` for the n-th request it reads (on any connection); a step returns False
    to close the connection after it. Counts connections and requests."""

    def __init__(self, *script: Step | bytes) -> None:
        self.script = list(script)
        self.requests = 0
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> "Upstream":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()  # type: ignore[union-attr]

    @property
    def key(self) -> tuple:
        return ("http", "127.0.0.1", self.server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                step = self.script[min(self.requests, len(self.script) - 1)]
                self.requests += 1
                if isinstance(step, bytes):
                    writer.write(step)
                    await writer.drain()
                elif not await step(reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def fetch(pool: Pool, upstream: Upstream, timeouts: Timeouts | None = None, limit: int | None = None) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        resp = await pool.request(upstream.key, REQUEST, BODY, timeouts or Timeouts())
        try:
            body = await (resp.read() if limit is None else resp.read(limit))
        finally:
            resp.release()
        return resp.status, body

    return await asyncio.wait_for(go(), WAIT)


async def test_interim_100_and_103_are_skipped_and_the_pool_stays_in_step() -> None:
    """Before: the 100 was relayed as the answer, the connection went back to the pool and the
    real 200 was read as the answer to the next request (another user's completion)."""
    async with Upstream(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\ncontent-type: text/html\r\n\r\n"
        + ok(b'{"for":"first"}'),
        ok(b'{"for":"second"}'),
    ) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b'{"for":"first"}')
        assert await fetch(pool, upstream) == (200, b'{"for":"second"}')
        assert upstream.connections == 1


async def test_interim_response_arriving_alone_then_the_answer() -> None:
    async def interim_then_answer(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the answer comes in a later read (not a barrier: any gap works)
        writer.write(ok(b"late"))
        return True

    async with Upstream(interim_then_answer, ok(b"next")) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b"late")
        assert await fetch(pool, upstream) == (200, b"next")


async def test_unasked_101_is_a_protocol_error() -> None:
    async with Upstream(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n" + ok(b"x")) as upstream:
        with pytest.raises(UpstreamError) as err:
            await fetch(Pool(4.0), upstream)
        assert err.value.kind == "protocol"


@pytest.mark.parametrize("status", [b"999", b"600", b"099", b"000"])
async def test_status_outside_100_599_is_a_protocol_error(status: bytes) -> None:
    async with Upstream(b"HTTP/1.1 " + status + b" Odd\r\ncontent-length: 2\r\n\r\nok") as upstream:
        with pytest.raises(UpstreamError) as err:
            await fetch(Pool(4.0), upstream)
        assert err.value.kind in ("protocol",)


@pytest.mark.parametrize("excess", [b"EXTRA", ok(b'{"for":"someone else"}')])
async def test_bytes_past_content_length_are_discarded_and_retire_the_connection(excess: bytes) -> None:
    async with Upstream(ok(b"ok") + excess, ok(b"second")) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b"ok")
        assert await fetch(pool, upstream) == (200, b"second")
        assert upstream.connections == 2  # the polluted connection was not reused


async def test_excess_bytes_in_a_later_read_never_reach_the_next_request() -> None:
    async def answer_then_more(reader, writer) -> bool:
        writer.write(ok(b"ok"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(ok(b"EVIL"))
        return True

    async with Upstream(answer_then_more, ok(b"second")) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b"ok")
        await asyncio.sleep(0.2)  # let the stray answer land on the pooled connection
        assert await fetch(pool, upstream) == (200, b"second")


@pytest.mark.parametrize("head", [
    b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n",
])
async def test_close_delimited_body_is_complete_at_the_close(head: bytes) -> None:
    async def close_delimited(reader, writer) -> bool:
        writer.write(head + b'{"part":1,')
        await writer.drain()
        writer.write(b'"part2":2}')
        return False

    async with Upstream(close_delimited, ok(b"again")) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b'{"part":1,"part2":2}')
        assert await fetch(pool, upstream) == (200, b"again")
        assert upstream.connections == 2


async def test_truncated_framed_body_is_an_error() -> None:
    async def truncated(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nonly5")
        return False

    async with Upstream(truncated) as upstream:
        with pytest.raises(UpstreamError) as err:
            await fetch(Pool(4.0), upstream)
        assert err.value.kind == "reset"


async def test_a_written_request_is_never_sent_twice() -> None:
    """The pooled connection dies after our request was written: before, the client sent it again
    on a fresh connection and the upstream ran a non-idempotent LLM call twice."""
    async def read_then_die(reader, writer) -> bool:
        return False

    async with Upstream(ok(b"first"), read_then_die, ok(b"third")) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b"first")
        with pytest.raises(UpstreamError) as err:
            await fetch(pool, upstream)
        assert err.value.kind == "reset"
        assert upstream.requests == 2  # the second request reached the upstream once
        assert await fetch(pool, upstream) == (200, b"third")


async def test_a_pooled_connection_closed_while_idle_is_not_used() -> None:
    async def answer_and_close(reader, writer) -> bool:
        writer.write(ok(b"first"))  # keep-alive claimed, then closed anyway
        return False

    async with Upstream(answer_and_close, ok(b"second")) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b"first")
        await asyncio.sleep(0.2)  # the close reaches us while the connection is idle
        assert await fetch(pool, upstream) == (200, b"second")
        assert upstream.requests == 2


async def test_a_pooled_connection_whose_transport_is_closing_is_not_used() -> None:
    """The transport closes before connection_lost runs (uvloop: a moment later): in between,
    the pool handed out the dead connection and the request failed (a 500 under load)."""
    async with Upstream(ok(b"first"), ok(b"second")) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b"first")
        (conn,) = pool._idle[upstream.key]
        conn.transport.close()  # connection_lost is only scheduled
        resp = await pool.request(upstream.key, REQUEST, BODY, Timeouts())  # no await before the reuse
        try:
            assert (resp.status, await asyncio.wait_for(resp.read(), WAIT)) == (200, b"second")
        finally:
            resp.release()


class _ClosedHandle:
    """A transport as uvloop leaves it after a reset, before connection_lost runs: is_closing()
    is still False, but writing raises RuntimeError (the handle is closed)."""

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True reading=False>; "
                           "the handler is closed")

    def abort(self) -> None:
        self.real.abort()


async def test_a_pooled_connection_whose_handle_closed_unannounced_is_replaced_unsent() -> None:
    """The write raised RuntimeError (a 500 in the rolling-restart test on Python 3.10): nothing
    was sent, so a fresh connection takes the request; on a connection of its own it is a
    connect error (retried on another replica), never an exception out of the pool."""
    async with Upstream(ok(b"first"), ok(b"second")) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b"first")
        (conn,) = pool._idle[upstream.key]
        conn.transport = _ClosedHandle(conn.transport)
        resp = await pool.request(upstream.key, REQUEST, BODY, Timeouts())
        try:
            assert (resp.status, await asyncio.wait_for(resp.read(), WAIT)) == (200, b"second")
        finally:
            resp.release()
        assert upstream.requests == 2 and conn.closed
        (again,) = pool._idle[upstream.key]
        again.transport = _ClosedHandle(again.transport)
        resp = again.start(REQUEST + BODY, 1.0, asyncio.get_running_loop().time() + 1.0)
        await asyncio.sleep(0)  # the pool's write pass runs
        assert resp.unsent and resp._error is not None and resp._error.kind == "connect" and again.closed


class _Recording:
    """A transport that records when it is written to."""

    def __init__(self, real: asyncio.Transport, log: list) -> None:
        self.real, self.log = real, log

    def is_closing(self) -> bool:
        return self.real.is_closing()

    def write(self, data: bytes) -> None:
        self.log.append(data)
        self.real.write(data)

    def abort(self) -> None:
        self.real.abort()


async def test_requests_started_in_one_turn_are_written_together_after_it() -> None:
    """One write pass per event-loop turn: a replica on the proxy's CPU is woken once per pass,
    not once per request (each wake-up preempted the proxy)."""
    async with Upstream(ok(b"a"), ok(b"b"), ok(b"c"), ok(b"d")) as upstream:
        pool = Pool(4.0)
        await asyncio.gather(fetch(pool, upstream), fetch(pool, upstream))  # two pooled connections
        log: list = []
        conns = pool._idle[upstream.key]
        assert len(conns) == 2
        for conn in conns:
            conn.transport = _Recording(conn.transport, log)
        deadline = asyncio.get_running_loop().time() + WAIT
        assert not pool.after_writes(lambda: log.append("early"))  # no pass pending: the caller runs it
        first, second = (conn.start(REQUEST + BODY, WAIT, deadline) for conn in list(conns))
        assert pool.after_writes(lambda: log.append("after the pass"))  # (the pick's bookkeeping)
        assert log == []  # nothing written while the turn routes
        await asyncio.sleep(0)
        assert log == [REQUEST + BODY] * 2 + ["after the pass"]
        for resp in (first, second):
            while not resp.done:
                await resp._wait(WAIT, "no answer")
            assert resp.status == 200


class _Failing(_Recording):
    def write(self, data: bytes) -> None:
        raise ValueError("a transport that fails oddly")


async def test_one_failing_write_does_not_stop_the_pass() -> None:
    async with Upstream(ok(b"a"), ok(b"b"), ok(b"c")) as upstream:
        pool = Pool(4.0)
        await asyncio.gather(fetch(pool, upstream), fetch(pool, upstream))
        log: list = []
        broken, fine = pool._idle[upstream.key]
        broken.transport = _Failing(broken.transport, log)
        fine.transport = _Recording(fine.transport, log)
        deadline = asyncio.get_running_loop().time() + WAIT
        failed, answered = broken.start(REQUEST + BODY, WAIT, deadline), fine.start(REQUEST + BODY, WAIT, deadline)
        await asyncio.sleep(0)
        assert log == [REQUEST + BODY] and failed.unsent and failed._error.kind == "connect" and broken.closed
        while not answered.done:
            await answered._wait(WAIT, "no answer")
        assert answered.status == 200


async def test_a_connection_lost_before_its_write_pass_sent_nothing() -> None:
    """Closed between the start of its request and the write pass: the request is unsent (a fresh
    connection may take it), never reported as a reset of a request the upstream might have run."""
    async with Upstream(ok(b"first"), ok(b"second")) as upstream:
        pool = Pool(4.0)
        assert await fetch(pool, upstream) == (200, b"first")
        (conn,) = pool._idle[upstream.key]
        resp = conn.start(REQUEST + BODY, WAIT, asyncio.get_running_loop().time() + WAIT)
        conn.transport.abort()
        conn.connection_lost(None)  # (as the transport reports it, before the pass)
        await asyncio.sleep(0)
        assert resp.unsent and resp._error is not None and resp._error.kind == "connect"
        assert upstream.requests == 1
        assert await fetch(pool, upstream) == (200, b"second")


async def drip(writer: asyncio.StreamWriter, data: bytes, gap: float = 0.05) -> None:
    for i in range(len(data)):
        writer.write(data[i:i + 1])
        await writer.drain()
        await asyncio.sleep(gap)


async def test_a_head_dripped_byte_by_byte_hits_the_first_byte_timeout() -> None:
    """Before: every byte restarted the first-byte timer, so a dripping head never timed out."""
    async def drip_head(reader, writer) -> bool:
        await drip(writer, b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 10_000)
        return False

    async with Upstream(drip_head) as upstream:
        with pytest.raises(UpstreamError) as err:
            await fetch(Pool(4.0), upstream, Timeouts(first_byte=0.5, idle=0.5))
        assert err.value.kind == "timeout"


async def test_a_body_dripped_byte_by_byte_hits_the_total_deadline() -> None:
    async def drip_body(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n")
        await drip(writer, b"a" * 100_000)
        return False

    async with Upstream(drip_body) as upstream:
        with pytest.raises(UpstreamError) as err:
            await fetch(Pool(4.0), upstream, Timeouts(idle=1.0, total=0.5))
        assert err.value.kind == "timeout"


async def test_a_stream_with_keepalive_pings_still_ends_at_the_total_deadline() -> None:
    async def silent_stream(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(WAIT)
        return False

    async with Upstream(silent_stream) as upstream:
        pool = Pool(4.0)
        resp = await pool.request(upstream.key, REQUEST, BODY, Timeouts(idle=5.0, total=0.5))

        async def relay() -> None:
            while await resp.next_chunk(keepalive=0.05) is not None:
                pass

        with pytest.raises(UpstreamError) as err:
            await asyncio.wait_for(relay(), WAIT)
        assert err.value.kind == "timeout"
        resp.release()


async def test_an_announced_huge_body_is_refused_before_reading_it() -> None:
    async def huge(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 300000000\r\n\r\n" + b"a" * 65536)
        await writer.drain()
        await asyncio.sleep(WAIT)
        return False

    async with Upstream(huge) as upstream:
        with pytest.raises(UpstreamError) as err:
            await fetch(Pool(4.0), upstream, limit=1 << 20)
        assert err.value.kind == "protocol"


async def test_a_chunked_body_past_the_limit_stops_buffering() -> None:
    chunk = b"a" * 65536

    async def endless(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(64):  # 4 MiB, a limit of 1 MiB must stop well before
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return True

    async with Upstream(endless) as upstream:
        with pytest.raises(UpstreamError) as err:
            await fetch(Pool(4.0), upstream, limit=1 << 20)
        assert err.value.kind == "protocol"
        assert "exceeds" in str(err.value)


async def test_an_endless_response_head_is_a_protocol_error() -> None:
    async def endless_head(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(40):  # 2.5 MiB of header lines
            writer.write(b"x-pad: " + b"a" * 65536 + b"\r\n")
            await writer.drain()
        await asyncio.sleep(WAIT)
        return False

    async with Upstream(endless_head) as upstream:
        with pytest.raises(UpstreamError) as err:
            await fetch(Pool(4.0), upstream)
        assert err.value.kind == "protocol"


async def test_malformed_answer_is_a_protocol_error() -> None:
    async with Upstream(b"SSH-2.0-OpenSSH_9.6\r\n") as upstream:
        with pytest.raises(UpstreamError) as err:
            await fetch(Pool(4.0), upstream)
        assert err.value.kind == "protocol"
