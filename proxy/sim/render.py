"""Response bodies and SSE chunks in the exact shapes vLLM's OpenAI server produces."""
from __future__ import annotations

import base64
import hashlib
import os
import struct
import time

import orjson

from proxy.sim.engine import Request

DONE = b"data: [DONE]\n\n"


def usage(req: Request) -> dict:
    prompt, completion = req.prompt_tokens, req.completion_tokens
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def _tool_call(req: Request, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{os.urandom(16).hex()}", "type": "function",
            "function": {"name": req.tool, "arguments": arguments}}


def chat_body(req: Request) -> bytes:
    choices = []
    for i, pieces in enumerate(req.outputs):
        text = "".join(pieces)
        if req.tool is None:
            message = {"role": "assistant", "reasoning_content": None, "content": text, "tool_calls": []}
        else:
            message = {"role": "assistant", "reasoning_content": None, "content": "",
                       "tool_calls": [_tool_call(req, text)]}
        choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": req.finish[i],
                        "stop_reason": None})
    return orjson.dumps({
        "id": f"chatcmpl-{os.urandom(16).hex()}", "object": "chat.completion", "created": int(time.time()),
        "model": req.model, "choices": choices, "usage": usage(req), "prompt_logprobs": None,
    })


def completion_body(req: Request) -> bytes:
    choices = [{"index": i, "text": "".join(pieces), "logprobs": None, "finish_reason": req.finish[i],
                "stop_reason": None, "prompt_logprobs": None} for i, pieces in enumerate(req.outputs)]
    return orjson.dumps({
        "id": f"cmpl-{os.urandom(16).hex()}", "object": "text_completion", "created": int(time.time()),
        "model": req.model, "choices": choices, "usage": usage(req),
    })


def embedding_body(req: Request, dim: int) -> bytes:
    as_base64 = req.options.get("encoding_format") == "base64"
    data = []
    for i, prompt in enumerate(req.prompts):
        vector = embed(prompt, dim)
        value = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode() if as_base64 else vector
        data.append({"index": i, "object": "embedding", "embedding": value})
    tokens = req.prompt_tokens
    return orjson.dumps({
        "id": f"embd-{os.urandom(16).hex()}", "object": "list", "created": int(time.time()), "model": req.model,
        "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                "prompt_tokens_details": None},
    })


def embed(tokens: list[int], dim: int) -> list[float]:
    """A deterministic unit vector for `tokens`."""
    digest = hashlib.shake_256(orjson.dumps(tokens)).digest(2 * dim)
    raw = [v - 32768 for v in struct.unpack(f"<{dim}H", digest)]
    norm = sum(v * v for v in raw) ** 0.5 or 1.0
    return [v / norm for v in raw]


class Stream:
    """The SSE events of one streamed chat or completion, step by step."""

    def __init__(self, req: Request) -> None:
        self.req = req
        chat = req.kind == "chat"
        self.chat = chat
        rid = f"chatcmpl-{os.urandom(16).hex()}" if chat else f"cmpl-{os.urandom(16).hex()}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.prefix = (b'data: {"id":"' + rid.encode() + b'","object":"' + obj.encode() + b'","created":'
                       + str(int(time.time())).encode() + b',"model":' + orjson.dumps(req.model) + b',"choices":[')

    def _event(self, choice: dict) -> bytes:
        return self.prefix + orjson.dumps(choice) + b"]}\n\n"

    def step(self, step: int) -> bytes:
        """All events of decoding step `step`: one per choice that has a token there (vLLM sends the
        role first, and the finish_reason on the chunk of the last token)."""
        req, events = self.req, []
        for i, pieces in enumerate(req.outputs):
            if step >= len(pieces):
                continue
            if step == 0 and self.chat:
                events.append(self._event({"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}))
            finish = req.finish[i] if step == len(pieces) - 1 else None
            piece = pieces[step]
            if not self.chat:
                choice = {"index": i, "text": piece, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            elif req.tool is None:
                choice = {"index": i, "delta": {"content": piece}, "logprobs": None, "finish_reason": finish}
            elif step == 0:
                call = _tool_call(req, piece)
                call["index"] = 0
                choice = {"index": i, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": i, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]},
                          "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None
            events.append(self._event(choice))
        return b"".join(events)

    def tail(self) -> bytes:
        """The usage event when asked for (stream_options.include_usage), then [DONE]."""
        if not self.req.include_usage:
            return DONE
        return self.prefix + b'],"usage":' + orjson.dumps(usage(self.req)) + b"}\n\n" + DONE
