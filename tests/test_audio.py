"""Audio transcriptions and translations through the proxy: multipart uploads routed by their
`model` form field, plain and streamed, with the body limit applied while the upload arrives."""
from __future__ import annotations

import io
import re
import select
import socket

import httpx
import openai
import pytest

from tests.conftest import MODEL, Servers, sim_of

AUDIO = bytes(range(256)) * 200  # 51 KB of "audio"


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0)


def test_transcription_plain_and_text(fleet) -> None:
    proxy, sims = fleet
    client = client_for(proxy.url)
    result = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", io.BytesIO(AUDIO), "audio/wav"))
    assert result.text.strip()
    text = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", io.BytesIO(AUDIO)),
                                              response_format="text")
    assert isinstance(text, str) and text.strip() == result.text.strip()
    assert sum(sim_of(s).stats()["requests"][MODEL] for s in sims) == 2


def test_transcription_streamed(fleet) -> None:
    proxy, _ = fleet
    client = client_for(proxy.url)
    plain = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", io.BytesIO(AUDIO))).text
    stream = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", io.BytesIO(AUDIO)), stream=True)
    events = list(stream)
    assert len(events) >= 8
    text = "".join(e.choices[0]["delta"]["content"] for e in events)  # vLLM's transcription.chunk events
    assert text == plain


def test_translation_and_deployment_rename(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, deployments=[{"name": "whisper", "model": MODEL}])
    client = client_for(proxy.url)
    result = client.audio.translations.create(model="whisper", file=("clip.wav", io.BytesIO(AUDIO)))
    assert result.text.strip()
    assert sim_of(sim).stats()["requests"][MODEL] == 1 and not sim_of(sim).stats()["not_found"]
    # the same through the short path (base URL without /v1)
    r = httpx.post(proxy.url + "/audio/translations", data={"model": "whisper"}, files={"file": ("a.wav", AUDIO)})
    assert r.status_code == 200 and r.json()["text"].strip()


def test_declared_upload_over_limit_is_413_before_reading_it(servers: Servers) -> None:
    proxy = servers.proxy_for(servers.sim(), server={"max_body_bytes": 64 * 1024})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 104857600\r\n\r\n--b\r\n")
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 413") and b'"code":"request_too_large"' in answer


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (its head and body may come in separate reads)."""
    answer = b""
    while True:
        head, sep, body = answer.partition(b"\r\n\r\n")
        if sep and (length := re.search(rb"(?im)^content-length: *(\d+)", head)) and len(body) >= int(length[1]):
            return answer
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return answer
        if not chunk:
            return answer
        answer += chunk


def test_chunked_upload_over_limit_is_refused_while_it_arrives(servers: Servers) -> None:
    """No Content-Length: the proxy answers 413 once the limit is passed, long before the client
    has sent the whole 64 MiB."""
    limit = 256 * 1024
    proxy = servers.proxy_for(servers.sim(), server={"max_body_bytes": limit})
    total, piece = 64 << 20, b"\0" * 16384
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: multipart/form-data; boundary=b\r\n\r\n")
        try:
            while sent < total:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
                if select.select([sock], [], [], 0)[0]:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = sock.recv(65536)
        except ConnectionResetError:
            pass
    assert sent < total // 4
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize("kwargs, status, code, param", [
    ({"content": b"not multipart", "headers": {"content-type": "application/json"}}, 400, "invalid_multipart", None),
    ({"content": b"--x\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=x"}}, 400,
     "invalid_multipart", None),
    ({"files": {"file": ("a.wav", AUDIO)}}, 400, "missing_required_parameter", "model"),
    ({"data": {"model": MODEL}, "files": {"other": ("a.wav", AUDIO)}}, 400, "missing_required_parameter", "file"),
    ({"data": {"model": "nope"}, "files": {"file": ("a.wav", AUDIO)}}, 404, "model_not_found", "model"),
    ({"data": {"model": MODEL, "stream": "maybe"}, "files": {"file": ("a.wav", AUDIO)}}, 400, "invalid_type",
     "stream"),
])
def test_bad_uploads_are_4xx_envelopes(fleet, kwargs: dict, status: int, code: str, param: str | None) -> None:
    proxy, sims = fleet
    r = httpx.post(proxy.url + "/v1/audio/transcriptions", **kwargs)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == param
    assert sum(sim_of(s).stats()["requests"][MODEL] for s in sims) == 0


def test_wrong_method(fleet) -> None:
    r = httpx.get(fleet[0].url + "/v1/audio/transcriptions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
