"""vLLM's tokenizer endpoints (`/tokenize`, `/detokenize`) and pooling-model endpoints (rerank,
score, classify, pooling), simulated with the stand-in tokenizer and deterministic scores.

Token ids are hashes (proxy/sim/tokenizer.py), so `/detokenize` maps them back through the
pieces this process has tokenized or generated: a round trip works on every replica of one
process (the test fleet, the demo), as it does on every vLLM replica of one model.
"""
from __future__ import annotations

import os
import time
import zlib

import orjson

from proxy.sim.errors import bad_request
from proxy.sim.models import Models
from proxy.sim.render import embed
from proxy.sim.tokenizer import WORDS, _PIECE, render_chat, token_id

_PIECES: dict[int, str] = {}


def _remember(pieces: list[str]) -> list[int]:
    ids = []
    for piece in pieces:
        tid = token_id(piece)
        _PIECES.setdefault(tid, piece)
        ids.append(tid)
    return ids


_remember([*WORDS, *(" " + w for w in WORDS)])


def _text(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{param}' must be a string.", param=param)
    return value


def _texts(value: object, param: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise bad_request(f"'{param}' must be a string or a non-empty list of strings.", param=param)


def _score(a: str, b: str) -> float:
    """A deterministic relevance in (0, 1): shared words raise it."""
    wa, wb = set(a.lower().split()), set(b.lower().split())
    overlap = len(wa & wb) / (len(wa | wb) or 1)
    jitter = (zlib.crc32(f"{a}\x00{b}".encode()) % 1000) / 100000
    return round(min(0.999, 0.05 + 0.9 * overlap + jitter), 6)


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


def _count(*texts: str) -> int:
    return sum(len(_PIECE.findall(t)) for t in texts)


def tokenize(body: dict, models: Models) -> bytes:
    models.resolve(body.get("model"))
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list.", param="messages")
        tokens = render_chat(messages, None)
    elif "prompt" in body:
        tokens = _remember(_PIECE.findall(_text(body["prompt"], "prompt")))
    else:
        raise bad_request("Either 'prompt' or 'messages' is required.", param="prompt")
    return orjson.dumps({"count": len(tokens), "max_model_len": models.config.max_model_len, "tokens": tokens,
                         "token_strs": None})


def detokenize(body: dict, models: Models) -> bytes:
    models.resolve(body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be a list of token ids.", param="tokens")
    unknown = [t for t in tokens if t not in _PIECES]
    if unknown:
        raise bad_request(f"Token id {unknown[0]} is out of vocabulary.", param="tokens")
    return orjson.dumps({"prompt": "".join(_PIECES[t] for t in tokens)})


def rerank(body: dict, models: Models) -> bytes:
    models.resolve(body.get("model"))
    query = _text(body.get("query"), "query")
    documents = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n") or len(documents)
    if not isinstance(top_n, int) or top_n < 0:
        raise bad_request("'top_n' must be a non-negative integer.", param="top_n")
    results = sorted(({"index": i, "document": {"text": d}, "relevance_score": _score(query, d)}
                      for i, d in enumerate(documents)), key=lambda r: -r["relevance_score"])[:top_n]
    tokens = _count(query, *documents)
    return orjson.dumps({"id": f"rerank-{os.urandom(16).hex()}", "model": body.get("model") or models.base_id,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results})


_SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


def score(body: dict, models: Models) -> bytes:
    models.resolve(body.get("model"))
    for first, second in _SCORE_PAIRS:
        if first in body and second in body:
            left, right = _texts(body[first], first), _texts(body[second], second)
            break
    else:
        raise bad_request("'text_1' and 'text_2' (or 'queries' and 'documents') are required.", param="text_1")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise bad_request("The two inputs must have the same length (or the first a single item).", param=first)
    data = [{"index": i, "object": "score", "score": _score(a, b)} for i, (a, b) in enumerate(zip(left, right))]
    return _listing("score", body, models, data, _count(*left, *right))


def classify(body: dict, models: Models) -> bytes:
    models.resolve(body.get("model"))
    texts = _texts(body.get("input"), "input")
    data = []
    for i, text in enumerate(texts):
        p = (zlib.crc32(text.encode()) % 1000) / 999
        data.append({"index": i, "label": "positive" if p >= 0.5 else "negative", "probs": [1 - p, p],
                     "num_classes": 2})
    return _listing("classify", body, models, data, _count(*texts))


def pooling(body: dict, models: Models) -> bytes:
    models.resolve(body.get("model"))
    texts = _texts(body.get("input"), "input")
    data = [{"index": i, "object": "pooling", "data": embed(_remember(_PIECE.findall(t)), models.config.embedding_dim)}
            for i, t in enumerate(texts)]
    return _listing("pool", body, models, data, _count(*texts))


def _listing(prefix: str, body: dict, models: Models, data: list, tokens: int) -> bytes:
    return orjson.dumps({"id": f"{prefix}-{os.urandom(16).hex()}", "object": "list", "created": int(time.time()),
                         "model": body.get("model") or models.base_id, "data": data, "usage": _usage(tokens)})
