"""vLLM's `/v1/audio/transcriptions` and `/v1/audio/translations`, simulated: multipart uploads,
a deterministic "transcript" derived from the audio bytes, plain (json/text) or streamed the way
vLLM streams it (`transcription.chunk` SSE events, then `[DONE]`)."""
from __future__ import annotations

import os
import time
import zlib

import orjson

from proxy.multipart import MultipartError, fields
from proxy.sim.errors import bad_request
from proxy.sim.models import Models
from proxy.sim.tokenizer import generate_words

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class Transcription:
    __slots__ = ("model", "words", "stream", "format", "seconds")

    def __init__(self, model: str, words: list[str], stream: bool, fmt: str, seconds: int) -> None:
        self.model, self.words, self.stream, self.format, self.seconds = model, words, stream, fmt, seconds


def parse(body: bytes, content_type: bytes, models: Models) -> Transcription:
    try:
        form = fields(body, content_type)
    except MultipartError as exc:
        raise bad_request(str(exc)) from None

    def text(name: str, default: str | None = None) -> str | None:
        f = form.get(name)
        return body[f.start:f.end].decode("utf-8", "replace") if f is not None else default

    upload = form.get("file")
    if upload is None or upload.end <= upload.start:
        raise bad_request("'file' is required (a non-empty audio upload).", param="file")
    model = text("model")
    models.resolve(model)
    fmt = text("response_format", "json")
    if fmt not in ("json", "text", "verbose_json"):
        raise bad_request(f"Unsupported response_format '{fmt}'.", param="response_format")
    stream = (text("stream", "false") or "").lower() == "true"
    size = upload.end - upload.start
    seed = zlib.crc32(body[upload.start:upload.start + 4096]) ^ size
    return Transcription(model or models.base_id, generate_words(seed, 8 + size % 8), stream, fmt, max(1, size // 32000))


def body(t: Transcription) -> tuple[bytes, bytes]:
    """(content type, body) of a plain answer."""
    transcript = "".join(t.words)
    if t.format == "text":
        return b"text/plain; charset=utf-8", transcript.encode()
    data: dict = {"text": transcript, "usage": {"type": "duration", "seconds": t.seconds}}
    if t.format == "verbose_json":
        data.update(language="en", duration=float(t.seconds), segments=[])
    return b"application/json", orjson.dumps(data)


def events(t: Transcription) -> list[bytes]:
    prefix = orjson.dumps({"id": f"trsc-{os.urandom(16).hex()}", "object": "transcription.chunk",
                           "created": int(time.time()), "model": t.model})[:-1]
    out = []
    for i, word in enumerate(t.words):
        finish = "stop" if i == len(t.words) - 1 else None
        choice = {"delta": {"content": word}, "finish_reason": finish, "stop_reason": None}
        out.append(b"data: " + prefix + b',"choices":[' + orjson.dumps(choice) + b"]}\n\n")
    out.append(b"data: [DONE]\n\n")
    return out
