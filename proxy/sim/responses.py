"""vLLM's stateful Responses API, simulated: `POST /v1/responses` (plain, streamed with named SSE
events, or in the background), `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.

Like vLLM (with VLLM_ENABLE_RESPONSES_API_STORE=1), each replica keeps the responses it created,
and the conversation behind them, in its own memory: a follow-up (`previous_response_id`), a
retrieval or a cancel only works on the replica that created the response.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Awaitable, Callable

import orjson

from proxy.sim.engine import Engine, Request
from proxy.sim.errors import SimError, bad_request
from proxy.sim.models import Models
from proxy.sim.protocol import _check_multimodal, _sampling
from proxy.sim.tokenizer import render_chat

Send = Callable[[dict], Awaitable[None]]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_TEXT_PARTS = ("input_text", "output_text", "text")


def not_found(response_id: str) -> SimError:
    return SimError(404, f"Response with id '{response_id}' not found.", param="response_id")


class Stored:
    """One response this replica created: the object clients see and the conversation so far."""

    __slots__ = ("response", "messages", "task")

    def __init__(self, response: dict, messages: list[dict]) -> None:
        self.response = response
        self.messages = messages
        self.task: asyncio.Task | None = None


def _messages(body: dict, history: list[dict]) -> list[dict]:
    """Chat messages for the engine: instructions, the stored conversation, then `input`."""
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string.", param="instructions")
        out.append({"role": "system", "content": instructions})
    out += history
    value = body.get("input")
    if isinstance(value, str):
        out.append({"role": "user", "content": value})
        return out
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of input items.", param="input")
    for item in value:
        if not isinstance(item, dict):
            raise bad_request("Each input item must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "function_call_output":
            out.append({"role": "tool", "content": str(item.get("output", ""))})
            continue
        if kind != "message" or not isinstance(item.get("role"), str):
            raise bad_request(f"Unsupported input item type '{kind}'.", param="input")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad_request("Each content part must be an object with a string 'type'.", param="input")
                if part["type"] in _TEXT_PARTS:
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                else:
                    parts.append(part)
            content = parts
        elif not isinstance(content, str):
            raise bad_request("Message content must be a string or a list of content parts.", param="input")
        out.append({"role": item["role"], "content": content})
    return out


def _has_media(messages: list[dict]) -> bool:
    return any(isinstance(m["content"], list) and any(p.get("type") != "text" for p in m["content"])
               for m in messages)


class ResponsesAPI:
    def __init__(self, engine: Engine, models: Models) -> None:
        self.engine = engine
        self.models = models
        self.store: dict[str, Stored] = {}

    def reset(self) -> None:
        self.store.clear()

    def _request(self, body: dict) -> tuple[Request, list[dict], dict]:
        config = self.models.config
        previous = body.get("previous_response_id")
        history: list[dict] = []
        if previous is not None:
            found = self.store.get(previous) if isinstance(previous, str) else None
            if found is None:
                raise SimError(404, f"Response with id '{previous}' not found.", param="previous_response_id")
            history = [m for m in found.messages if m["role"] != "system"]
        messages = _messages(body, history)
        multimodal = _check_multimodal(body, _has_media(messages), config)
        adapter = self.models.resolve(body.get("model"))
        req = Request("chat", body.get("model") or self.models.base_id, adapter, [render_chat(messages, None)],
                      multimodal=multimodal)
        sampling = {"max_tokens": body.get("max_output_tokens"), "stream": body.get("stream")}
        _sampling(req, {k: v for k, v in sampling.items() if v is not None}, config)
        now = int(time.time())
        response = {
            "id": f"resp_{os.urandom(16).hex()}", "object": "response", "created_at": now, "model": req.model,
            "status": "in_progress", "output": [], "instructions": body.get("instructions"),
            "previous_response_id": previous, "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0,
            "background": bool(body.get("background")), "store": body.get("store", True) is not False,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": body.get("metadata"),
            "error": None, "incomplete_details": None, "usage": None, "user": None,
        }
        return req, messages, response

    def parse(self, body: dict, models: Models) -> Request:
        """The engine request; the conversation and the response object ride in `options`."""
        req, messages, response = self._request(body)
        req.options = {"messages": messages, "response": response}
        return req

    async def create(self, req: Request, send: Send) -> bytes | None:
        """Runs `req` (from `parse`); returns the JSON body to send, or None once it streamed."""
        response = req.options["response"]
        stored = Stored(response, req.options["messages"])
        if response["store"]:
            self.store[response["id"]] = stored
        if response["background"]:
            if not response["store"]:
                raise bad_request("background mode needs store=true.", param="background")
            response["status"] = "queued"
            stored.task = asyncio.get_running_loop().create_task(self._finish_in_background(req, stored))
            return orjson.dumps(response)
        if not req.stream:
            await self.engine.execute(req)
            _complete(req, stored)
            return orjson.dumps(response)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        events = _Events(req, response)
        await send({"type": "http.response.body", "body": events.opening(), "more_body": True})

        async def emit(step: int) -> None:
            await send({"type": "http.response.body", "body": events.delta(step), "more_body": True})

        await self.engine.execute(req, emit)
        _complete(req, stored)
        await send({"type": "http.response.body", "body": events.closing(), "more_body": False})
        return None

    async def _finish_in_background(self, req: Request, stored: Stored) -> None:
        stored.response["status"] = "in_progress"
        await self.engine.execute(req)
        _complete(req, stored)

    def get(self, response_id: str) -> dict:
        found = self.store.get(response_id)
        if found is None:
            raise not_found(response_id)
        return found.response

    def cancel(self, response_id: str) -> dict:
        found = self.store.get(response_id)
        if found is None:
            raise not_found(response_id)
        if not found.response["background"]:
            raise bad_request("Cannot cancel a synchronous response.", param="response_id")
        if found.task is not None and not found.task.done():
            found.task.cancel()
            found.response["status"] = "cancelled"
        return found.response


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status or "in_progress",
            "content": content}


def _complete(req: Request, stored: Stored) -> None:
    text = "".join(req.outputs[0])
    response = stored.response
    response["status"] = "completed" if req.finish[0] == "stop" else "incomplete"
    if response["status"] == "incomplete":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    response["output"] = [_message_item(f"msg_{os.urandom(16).hex()}", text, "completed")]
    response["usage"] = {
        "input_tokens": req.prompt_tokens, "input_tokens_details": {"cached_tokens": req.cached_tokens},
        "output_tokens": req.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": req.prompt_tokens + req.completion_tokens,
    }
    stored.messages = [*stored.messages, {"role": "assistant", "content": text}]


class _Events:
    """The named SSE events of one streamed response, as vLLM sends them (`event: <type>` lines)."""

    def __init__(self, req: Request, response: dict) -> None:
        self.req = req
        self.response = response
        self.item_id = f"msg_{os.urandom(16).hex()}"
        self.sequence = 0

    def _event(self, kind: str, **fields: object) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _at(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def opening(self) -> bytes:
        return b"".join((
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
            self._event("response.output_item.added", output_index=0, item=_message_item(self.item_id, "", "")),
            self._event("response.content_part.added", **self._at(),
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
        ))

    def delta(self, step: int) -> bytes:
        pieces = self.req.outputs[0]
        if step >= len(pieces):
            return b""
        return self._event("response.output_text.delta", **self._at(), delta=pieces[step], logprobs=[])

    def closing(self) -> bytes:
        text = "".join(self.req.outputs[0])
        self.response["output"][0]["id"] = self.item_id
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return b"".join((
            self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
            self._event("response.content_part.done", **self._at(), part=part),
            self._event("response.output_item.done", output_index=0, item=self.response["output"][0]),
            self._event("response.completed", response=self.response),
        ))

