"""The uvicorn internals proxy/server.py (with proxy/intake.py, and proxy/drain.py) build on, pinned one by one.

uvicorn is pinned to one minor version (pyproject.toml); raising the pin means this file passes
against the new version. Each name below is private API: if uvicorn renames or drops it, the
lean cycle breaks in ways the other tests may see only as hangs. The last tests check that the
list is complete (proxy/server.py and proxy/intake.py use no other inherited name) and that the uvicorn options the
lean cycle cannot honour are refused, not ignored.
"""
from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path
from unittest import mock

import pytest
import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http import flow_control, httptools_impl
from uvicorn.server import ServerState

from proxy.drain import DrainingServer
from proxy.server import UNSUPPORTED_OPTIONS, LeanCycle, ProxyProtocol

SERVER_PY = Path(__file__).resolve().parent.parent / "proxy" / "server.py"
INTAKE_PY = SERVER_PY.with_name("intake.py")

# HttpToolsProtocol attributes ProxyProtocol (or its Intake) reads or writes (set by its __init__,
# connection_made or per request)
PROTOCOL_ATTRIBUTES = {
    "app", "app_state", "asgi_version", "client", "config", "connections", "cycle", "expect_100_continue", "flow",
    "headers", "limit_concurrency", "logger", "loop", "parser", "root_path", "scheme", "scope", "server",
    "server_state", "tasks", "timeout_keep_alive", "transport", "url", "pipeline",
}
# HttpToolsProtocol methods ProxyProtocol overrides or calls (drain.py: shutdown)
PROTOCOL_METHODS = {
    "connection_made": ["transport"], "connection_lost": ["exc"],
    "on_headers_complete": [], "on_body": ["body"], "on_message_complete": [], "send_400_response": ["msg"],
    "on_response_complete": [], "shutdown": [], "resume_writing": [], "_start_asgi_task": ["cycle", "app"],
    "_should_upgrade": [], "handle_websocket_upgrade": [], "_unsupported_upgrade_warning": [],
}
CYCLE_ATTRIBUTES = {"response_complete", "response_started", "disconnected", "message_event", "keep_alive"}
SERVER_STATE_ATTRIBUTES = {"default_headers", "connections", "tasks", "total_requests"}
FLOW_ATTRIBUTES = {"pause_reading", "resume_reading", "read_paused", "write_paused", "drain"}
SERVER_ATTRIBUTES = {"server_state", "config", "force_exit", "servers", "lifespan", "startup", "shutdown"}


async def _app(scope, receive, send) -> None:  # pragma: no cover - never called
    pass


@pytest.fixture
def protocol():
    loop = asyncio.new_event_loop()
    try:
        proto = httptools_impl.HttpToolsProtocol(Config(_app, lifespan="off"), ServerState(), {}, _loop=loop)
        proto.on_message_begin()  # per-request state (url, headers, scope)
        yield proto
    finally:
        loop.close()


def test_module_names() -> None:
    assert isinstance(httptools_impl.STATUS_LINE, dict) and httptools_impl.STATUS_LINE[200].startswith(b"HTTP/1.1 200")
    assert set(range(100, 600)) <= set(httptools_impl.STATUS_LINE)
    assert isinstance(flow_control.HIGH_WATER_LIMIT, int) and flow_control.HIGH_WATER_LIMIT > 0
    assert uvicorn.config.STARTUP_FAILURE == 3
    assert issubclass(ProxyProtocol, httptools_impl.HttpToolsProtocol)


def test_protocol_attributes_and_methods(protocol) -> None:
    missing = sorted(name for name in PROTOCOL_ATTRIBUTES if not hasattr(protocol, name))
    assert missing == []
    for name, params in PROTOCOL_METHODS.items():
        method = getattr(httptools_impl.HttpToolsProtocol, name)
        assert list(inspect.signature(method).parameters)[1:] == params, name
    assert protocol.server_state is not None and protocol.connections is protocol.server_state.connections
    assert protocol.tasks is protocol.server_state.tasks


def test_server_state_flow_and_cycle_attributes(protocol) -> None:
    state = ServerState()
    assert all(hasattr(state, name) for name in SERVER_STATE_ATTRIBUTES)
    flow = flow_control.FlowControl(mock.Mock())
    assert all(hasattr(flow, name) for name in FLOW_ATTRIBUTES)
    cycle = httptools_impl.RequestResponseCycle(
        scope={"method": "GET"}, transport=mock.Mock(), flow=flow, logger=mock.Mock(), access_logger=mock.Mock(),
        access_log=False, default_headers=[], message_event=asyncio.Event(), expect_100_continue=False,
        keep_alive=True, on_response=lambda: None,
    )
    assert sorted(name for name in CYCLE_ATTRIBUTES if not hasattr(cycle, name)) == []


def test_server_attributes() -> None:
    server = uvicorn.Server(Config(_app))
    source = inspect.getsource(uvicorn.Server)
    for name in SERVER_ATTRIBUTES:
        assert hasattr(server, name) or f"self.{name} =" in source or f"self.{name}:" in source, name
    for name in ("startup", "shutdown"):
        assert list(inspect.signature(getattr(uvicorn.Server, name)).parameters) == ["self", "sockets"], name


def test_lean_cycle_has_everything_uvicorns_protocol_reads_on_a_cycle() -> None:
    """LeanCycle stands in for RequestResponseCycle wherever uvicorn's protocol code touches
    `self.cycle` (connection_lost, shutdown, on_response_complete, ...)."""
    tree = ast.parse(inspect.getsource(httptools_impl.HttpToolsProtocol))
    read = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "cycle" and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}
    assert read >= {"response_complete", "disconnected", "message_event"}
    # (its attributes are slots from source, descriptors compiled (proxy/native.py): dir() lists both)
    provided = {n for n in dir(LeanCycle) if not n.startswith("__")}
    assert sorted(read - provided) == []


def test_the_list_is_complete() -> None:
    """Every `self.<name>` ProxyProtocol uses is its own or pinned above."""
    cls = next(n for n in ast.parse(SERVER_PY.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "ProxyProtocol")
    own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    own |= {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    used, assigned = set(), set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            used.add(node.attr)
            if isinstance(node.ctx, ast.Store):
                assigned.add(node.attr)
    pinned = PROTOCOL_ATTRIBUTES | set(PROTOCOL_METHODS)
    own |= assigned - pinned  # per-connection state of our own (_refusal, _unsent, ...)
    assert sorted(used - own - pinned) == []
    # the intake reaches the protocol as `p` or `protocol` (or `self.protocol`)
    via_intake = {node.attr for node in ast.walk(ast.parse(INTAKE_PY.read_text()))
                  if isinstance(node, ast.Attribute) and (
                      isinstance(node.value, ast.Name) and node.value.id in ("p", "protocol")
                      or isinstance(node.value, ast.Attribute) and node.value.attr == "protocol")}
    assert via_intake >= {"cycle", "server_state", "transport"}  # (the walk finds them)
    assert sorted(via_intake - own - pinned) == []


@pytest.mark.parametrize("option, value", [("limit_concurrency", 10), ("root_path", "/api"), ("reset_contextvars", True)])
def test_options_the_lean_cycle_skips_are_refused_at_startup(option: str, value) -> None:
    assert UNSUPPORTED_OPTIONS[option] != value
    config = Config(_app, http=ProxyProtocol, lifespan="off", port=0, **{option: value})
    with pytest.raises(SystemExit) as exit_:
        asyncio.run(DrainingServer(config).startup())
    assert exit_.value.code == uvicorn.config.STARTUP_FAILURE
    # under another server: refused on the first connection, never silently served
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match=option):
            ProxyProtocol(config, ServerState(), {}, _loop=loop)
    finally:
        loop.close()


def test_default_options_start() -> None:
    loop = asyncio.new_event_loop()
    try:
        ProxyProtocol(Config(_app, http=ProxyProtocol, lifespan="off"), ServerState(), {}, _loop=loop)
    finally:
        loop.close()
