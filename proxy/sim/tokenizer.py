"""A deterministic stand-in tokenizer (~1 token per 4 characters) and the chat template.

Token ids only need to be stable and prefix-preserving so that the prefix cache behaves like
vLLM's: equal leading text gives equal leading tokens. Messages are tokenized one by one and
concatenated, so a conversation's next turn extends the previous turn's tokens exactly, and
generated words re-tokenize to the very ids they were generated as.
"""
from __future__ import annotations

import re
import zlib
from functools import lru_cache

import orjson

VOCAB = 128_000
MEDIA_TOKENS = 16  # one block's worth per image/audio/video part
_PIECE = re.compile(r" ?[^\W\d_]{1,4}| ?\d{1,3}| ?[^\w\s]{1,4}|\s+")
# Generated words: at most 4 letters, so " word" is exactly one token.
WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by "
    "hot word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them".split()
)


def token_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % VOCAB


@lru_cache(maxsize=16384)
def tokenize(text: str) -> tuple[int, ...]:
    """Token ids of `text` (cached: system prompts and history repeat across requests)."""
    return tuple(token_id(p) for p in _PIECE.findall(text))


def media_tokens(part: dict) -> tuple[int, ...]:
    """A few tokens standing for one media item, derived from its URL/data so equal media hit the cache."""
    seed = zlib.crc32(orjson.dumps(part))
    return tuple((seed + 7919 * i) % VOCAB for i in range(MEDIA_TOKENS))


@lru_cache(maxsize=64)
def _header(role: str) -> tuple[int, ...]:
    return tokenize(f"<|{role}|>\n")


_NL = tokenize("\n")


def render_chat(messages: list[dict], tools: list | None) -> list[int]:
    """Prompt tokens of a chat: tools JSON, then `<|role|>\\n{content}\\n` per message, then the
    assistant header (add_generation_prompt). Messages are assumed validated."""
    out: list[int] = []
    if tools:
        out += _header("tools")
        out += tokenize(orjson.dumps(tools).decode())
        out += _NL
    for message in messages:
        out += _header(message["role"])
        content = message.get("content")
        if isinstance(content, str):
            out += tokenize(content)
        elif isinstance(content, list):
            for part in content:
                if part.get("type") == "text":
                    out += tokenize(part.get("text") or "")
                else:
                    out += media_tokens(part)
        if message.get("tool_calls"):
            out += tokenize(orjson.dumps(message["tool_calls"]).decode())
        out += _NL
    out += _header("assistant")
    return out


def generate_words(seed: int, count: int) -> list[str]:
    """`count` deterministic text pieces (one token each) for a choice seeded by `seed`."""
    words = WORDS
    size = len(words)
    x = seed & 0xFFFFFFFFFFFFFFFF
    out = []
    for i in range(count):
        x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        word = words[(x >> 33) % size]
        out.append(word if i == 0 else " " + word)
    return out


def natural_length(seed: int) -> int:
    """How many tokens a choice runs before it 'emits EOS' (finish_reason "stop"): 64..511, so
    the usual small max_tokens is always reached exactly, and long generations still end."""
    return 64 + (seed >> 7) % 448
