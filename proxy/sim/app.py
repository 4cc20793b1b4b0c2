"""The replica's HTTP server as a raw ASGI app: vLLM's OpenAI endpoints plus /sim/* controls.

Raw ASGI keeps the hot path cheap and lets inference requests watch `receive()` for
`http.disconnect` while they queue, prefill or stream, so a departed client's request is
aborted at once (as vLLM does), never left occupying the batch.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Coroutine

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from functools import partial

from proxy.sim import audio, pooling, protocol, render
from proxy.sim.responses import ResponsesAPI
from proxy.sim.config import SimConfig
from proxy.sim.engine import Engine, Request
from proxy.sim.errors import SimError
from proxy.sim.faults import Faults
from proxy.sim.metrics import SimMetrics
from proxy.sim.models import Models

VERSION = "0.31.0-sim"
JSON = b"application/json"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
Send = Callable[[dict], Awaitable[None]]
Handler = Callable[[bytes, Send], Awaitable[None]]


async def respond(send: Send, status: int, body: bytes, content_type: bytes = JSON) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Callable[[], Awaitable[dict]]) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body
    chunks = [body]
    while message.get("more_body"):
        message = await receive()
        chunks.append(message.get("body", b""))
    return b"".join(chunks)


POOLING = {
    "/tokenize": pooling.tokenize, "/detokenize": pooling.detokenize,
    "/v1/rerank": pooling.rerank, "/rerank": pooling.rerank, "/v2/rerank": pooling.rerank,
    "/v1/score": pooling.score, "/score": pooling.score, "/classify": pooling.classify, "/pooling": pooling.pooling,
}


class SimApp:
    """One independent simulated replica; `engine`, `models`, `metrics`, `faults` are its live state."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.metrics = SimMetrics(config.model_id)
        self.models = Models(config)
        self.faults = Faults()
        self.engine = Engine(config, self.models, self.metrics, self.faults)
        self.responses = ResponsesAPI(self.engine, self.models)
        self._auth = f"Bearer {config.api_key}".encode() if config.api_key else None
        # path -> (method, handler, watch for client disconnect)
        self._routes: dict[str, tuple[str, Handler, bool]] = {
            "/v1/chat/completions": ("POST", self._chat, True),
            "/v1/completions": ("POST", self._completion, True),
            "/v1/embeddings": ("POST", self._embedding, True),
            "/v1/models": ("GET", self._list_models, False),
            "/v1/load_lora_adapter": ("POST", self._load_lora, True),
            "/v1/unload_lora_adapter": ("POST", self._unload_lora, False),
            "/v1/responses": ("POST", self._create_response, True),
            **{path: ("POST", partial(self._pooling, fn), False) for path, fn in POOLING.items()},
            "/health": ("GET", self._health, False),
            "/metrics": ("GET", self._metrics, False),
            "/version": ("GET", self._version, False),
        }
        self._sim_routes: dict[str, tuple[str, Handler]] = {
            "/sim/stats": ("GET", self._stats),
            "/sim/faults": ("POST", self._set_faults),
            "/sim/reset": ("POST", self._reset),
        }

    @property
    def sim(self) -> "SimApp":
        return self

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            body = await read_body(receive) if scope["method"] != "GET" else b""
            if path.startswith("/sim/"):
                await self._serve(self._sim_routes.get(path), scope, body, send)
                return
            route = self._routes.get(path) or self._dynamic_route(scope)
            work = self._serve(route, scope, body, send)
            if self.faults.hang or (route is not None and route[2]):
                await self._until_disconnect(work, receive)
            else:
                await work
        elif scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _serve(self, route: tuple | None, scope: dict, body: bytes, send: Send) -> None:
        if not scope["path"].startswith("/sim/"):
            await self.faults.wait_unhung()
        if route is None:
            return await respond(send, 404, b'{"detail":"Not Found"}')
        if scope["method"] != route[0]:
            return await respond(send, 405, b'{"detail":"Method Not Allowed"}')
        if self._auth is not None and scope["path"].startswith("/v1") and not self._authorized(scope):
            return await respond(send, 401, b'{"error":"Unauthorized"}')
        try:
            await route[1](body, send)
        except SimError as exc:  # always raised before the response started
            await respond(send, exc.status, exc.body())

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return value == self._auth
        return False

    @staticmethod
    async def _until_disconnect(work: Coroutine[Any, Any, None], receive: Callable[[], Awaitable[dict]]) -> None:
        """Run `work` in this task, cancelling it as soon as the client disconnects."""
        task = asyncio.current_task()
        state = {"finished": False, "disconnected": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["finished"]:
                state["disconnected"] = True
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await work
        except asyncio.CancelledError:
            if not state["disconnected"]:
                raise
            if hasattr(task, "uncancel"):
                task.uncancel()
        except OSError:  # the client vanished while we were writing
            pass
        finally:
            state["finished"] = True
            watcher.cancel()

    # --- inference --------------------------------------------------------------------------

    async def _admit(self, body: bytes, parse: Callable[[dict, Models], Request]) -> Request:
        faults = self.faults
        if faults.slow_ms:
            await asyncio.sleep(faults.slow_ms / 1000)
        if faults.should_fail():
            raise SimError(faults.error_status, "Simulated engine failure (fault injection).")
        await faults.before_first_token(body)
        data = protocol.parse_json(body)
        try:
            req = parse(data, self.models)
        except SimError as exc:
            if exc.status == 404:  # a model/adapter this replica does not hold (tests: never routed here)
                self.engine.stats.not_found[str(data.get("model") if isinstance(data, dict) else None)] += 1
            raise
        stats = self.engine.stats
        stats.requests[req.adapter or self.models.base_id] += 1
        stats.multimodal += req.multimodal
        return req

    async def _generate(self, body: bytes, send: Send, parse: Callable[[dict, Models], Request],
                        render_body: Callable[[Request], bytes]) -> None:
        hung = self.faults.wait_unhung  # a hang also stalls requests already running, as SIGSTOP does
        req = await self._admit(body, parse)
        if not req.stream:
            await self.engine.execute(req)
            await hung()
            return await respond(send, 200, render_body(req))
        stream = render.Stream(req)
        # like vLLM (a Starlette StreamingResponse), headers go out before the request is scheduled
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        async def emit(step: int) -> None:
            await hung()
            await send({"type": "http.response.body", "body": stream.step(step), "more_body": True})

        await self.engine.execute(req, emit)
        await hung()
        await send({"type": "http.response.body", "body": stream.tail(), "more_body": False})

    async def _chat(self, body: bytes, send: Send) -> None:
        await self._generate(body, send, protocol.parse_chat, render.chat_body)

    async def _completion(self, body: bytes, send: Send) -> None:
        await self._generate(body, send, protocol.parse_completion, render.completion_body)

    async def _embedding(self, body: bytes, send: Send) -> None:
        req = await self._admit(body, protocol.parse_embedding)
        await self.engine.execute(req)
        await respond(send, 200, render.embedding_body(req, self.config.embedding_dim))

    # --- Responses API, tokenizer and pooling endpoints, audio (proxy/sim/responses.py, pooling.py, audio.py)

    def _dynamic_route(self, scope: dict) -> tuple[str, Handler, bool] | None:
        path = scope["path"]
        if path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            ctype = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
            return "POST", partial(self._transcribe, ctype), True
        if path.startswith("/v1/responses/"):
            rest = path[len("/v1/responses/"):]
            if rest.endswith("/cancel"):
                return "POST", partial(self._cancel_response, rest[:-len("/cancel")]), False
            return "GET", partial(self._get_response, rest), False
        return None

    async def _create_response(self, body: bytes, send: Send) -> None:
        req = await self._admit(body, self.responses.parse)
        answer = await self.responses.create(req, send)
        if answer is not None:
            await respond(send, 200, answer)

    async def _get_response(self, response_id: str, body: bytes, send: Send) -> None:
        await respond(send, 200, orjson.dumps(self.responses.get(response_id)))

    async def _cancel_response(self, response_id: str, body: bytes, send: Send) -> None:
        await respond(send, 200, orjson.dumps(self.responses.cancel(response_id)))

    async def _pooling(self, fn: Callable[[dict, Models], bytes], body: bytes, send: Send) -> None:
        if self.faults.should_fail():
            raise SimError(self.faults.error_status, "Simulated engine failure (fault injection).")
        await respond(send, 200, fn(protocol.parse_json(body), self.models))

    async def _transcribe(self, content_type: bytes, body: bytes, send: Send) -> None:
        if self.faults.should_fail():
            raise SimError(self.faults.error_status, "Simulated engine failure (fault injection).")
        t = audio.parse(body, content_type, self.models)
        self.engine.stats.requests[self.models.resolve(t.model) or self.models.base_id] += 1
        if not t.stream:
            return await respond(send, 200, *reversed(audio.body(t)))
        await send({"type": "http.response.start", "status": 200, "headers": audio.SSE_HEADERS})
        for event in audio.events(t):
            await asyncio.sleep(self.config.delay(self.config.itl_ms))
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # --- models and adapters ----------------------------------------------------------------

    async def _list_models(self, body: bytes, send: Send) -> None:
        await respond(send, 200, orjson.dumps(self.models.cards()))

    async def _load_lora(self, body: bytes, send: Send) -> None:
        data = protocol.parse_json(body)
        name, path = self.models.check_load(data.get("lora_name"), data.get("lora_path"))
        if self.faults.fail_lora_loads:
            raise SimError(400, f"Loading lora {name} failed: simulated fault.", param="lora_path")
        delay = self.config.delay(self.config.lora_load_ms)
        if delay:
            await asyncio.sleep(delay)
        self.models.check_load(name, path)  # a concurrent load may have won
        self.models.add(name, path)
        await respond(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(),
                      b"text/plain; charset=utf-8")

    async def _unload_lora(self, body: bytes, send: Send) -> None:
        name = protocol.parse_json(body).get("lora_name")
        self.models.remove(name)
        await respond(send, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(),
                      b"text/plain; charset=utf-8")

    # --- operations -------------------------------------------------------------------------

    async def _health(self, body: bytes, send: Send) -> None:
        await respond(send, 200, b"")

    async def _metrics(self, body: bytes, send: Send) -> None:
        await respond(send, 200, self.metrics.exposition(), CONTENT_TYPE_LATEST.encode())

    async def _version(self, body: bytes, send: Send) -> None:
        await respond(send, 200, orjson.dumps({"version": VERSION}))

    # --- /sim/* -----------------------------------------------------------------------------

    def stats(self) -> dict:
        engine, models = self.engine, self.models
        s = engine.stats
        served = dict.fromkeys([models.base_id, *models.adapters], 0)
        return {
            "requests": {**served, **s.requests}, "not_found": dict(s.not_found), "multimodal_requests": s.multimodal,
            "running": len(engine.running), "waiting": len(engine.waiting), "held": engine.held,
            "completed": s.completed, "aborted": s.aborted,
            "lora_loads": models.loads, "lora_unloads": models.unloads, "lora_reloads": models.reloads,
            "prefix_cache": {"queries": s.prefix_queries, "hits": s.prefix_hits, "blocks": len(engine.cache),
                             "evictions": engine.cache.evictions},
            "kv_cache_usage": engine.kv_usage(), "faults": self.faults.as_dict(),
        }

    async def _stats(self, body: bytes, send: Send) -> None:
        await respond(send, 200, orjson.dumps(self.stats()))

    async def _set_faults(self, body: bytes, send: Send) -> None:
        self.faults.update(protocol.parse_json(body) if body else {})
        await respond(send, 200, orjson.dumps(self.faults.as_dict()))

    async def _reset(self, body: bytes, send: Send) -> None:
        """Clear faults, prefix cache and /sim/stats counters (Prometheus counters keep counting)."""
        self.faults.reset()
        self.engine.reset()
        self.responses.reset()
        await respond(send, 200, orjson.dumps(self.stats()))


def create_app(config: SimConfig | None = None) -> SimApp:
    """A fresh replica with its own state and Prometheus registry."""
    return SimApp(config or SimConfig())
