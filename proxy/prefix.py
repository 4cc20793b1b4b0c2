"""Prefix keys: chained hashes of fixed-size blocks of the rendered prompt.

vLLM's prefix cache reuses the KV of a shared leading token run; its key is a chain of block
hashes. We approximate it on text, seeded with the upstream model and adapter (different models
never share keys). The **pin key** covers the leading system/developer message(s): the part a
tenant repeats in every conversation, so it decides a replica when no longer match is known.
Hashes are 64-bit ints from blake2b: stable across processes, so every proxy agrees. A tenant
repeats its system part in every request, so the hashes of that part are kept (a bounded LRU):
hashing a 2 KB system prompt per request was half of the routing decision's cost.
"""
from __future__ import annotations

from hashlib import blake2b
from typing import Any, Final, NamedTuple

import orjson

_SYSTEM_ROLES: Final = ("system", "developer")
_MEDIA_SAMPLE: Final = 4096  # bytes of a data: URL's head and tail that identify it (plus its length)
_SYSTEM_CACHE_BYTES: Final = 16 << 20  # system-part text whose hashes are kept, in bytes
_SEEDS: Final = 4096  # seeds (upstream model and adapter ids) whose leading hash is kept


class PrefixKey(NamedTuple):  # a tuple: built once per request, cheaper than a frozen dataclass
    pin: int
    chain: tuple[int, ...]  # hash of blocks [0..i] for each full block i (capped)
    pin_blocks: int  # how many leading chain entries lie inside the pinned (system) part


_new_key: Final = tuple.__new__  # PrefixKey(...) without the named tuple's own __new__ (a Python call)


_BLAKE8: Final = blake2b(digest_size=8)  # copied per hash: cheaper than a constructor parsing its keyword


def _h(data: bytes) -> int:
    h = _BLAKE8.copy()
    h.update(data)
    return int.from_bytes(h.digest(), "little")


def media_digest(url: str) -> str:
    """A bounded stand-in for a media URL: identical images give identical keys, and a large
    base64 payload is never hashed whole."""
    if url.startswith("data:") and len(url) > 2 * _MEDIA_SAMPLE:
        sample = url[:_MEDIA_SAMPLE] + url[-_MEDIA_SAMPLE:]
        return "data#%d#%016x" % (len(url), _h(sample.encode("utf-8", "surrogatepass")))
    return url


def _part_text(part: Any) -> str:
    if not isinstance(part, dict):
        return ""
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        return text if isinstance(text, str) else ""
    value = part.get(kind) if isinstance(kind, str) else None
    if isinstance(value, dict):
        url = value.get("url")
        if isinstance(url, str):
            return "\x1d" + media_digest(url)
        data = value.get("data")
        if isinstance(data, str):
            return "\x1d" + media_digest(data)
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p) for p in content)
    return ""


def render_chat(data: dict[str, Any]) -> tuple[bytes, int]:
    """The prompt as bytes, and where the leading system part ends (0 if there is none)."""
    pieces: list[str] = []
    size = 0  # characters before the first message that is not a system one
    tools = data.get("tools")
    if tools:
        pieces.append(orjson.dumps(tools).decode())
        size = len(pieces[0])
    system_end = -1
    messages: list[dict[str, Any]] = data["messages"]  # (checked by proxy/parse.py: objects in a list)
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        piece = f"\x1e{role}\x1f{content if isinstance(content, str) else _content_text(content)}"
        if system_end < 0:
            if role in _SYSTEM_ROLES:
                size += len(piece)
            else:
                system_end = size
        pieces.append(piece)
    if system_end < 0:
        system_end = size
    text = "".join(pieces)
    # offsets are in characters; convert the boundary to bytes only when non-ASCII makes them differ
    if not text.isascii():
        system_end = len(text[:system_end].encode("utf-8", "surrogatepass"))
    return text.encode("utf-8", "surrogatepass"), system_end


def render_prompt(prompt: Any) -> bytes:
    """Completions: a string, token ids, or the first of a batch of either (a list of token ids is
    one prompt, not a batch: taking its first id gave every token-id prompt the same empty key,
    one tenant for all of them)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    if isinstance(prompt, list):
        return orjson.dumps(prompt)
    return b""


class _SystemHashes:
    """(seed, block size, system part) -> (pin, hashes of the blocks inside it, last hash), bounded
    by the bytes of system text it holds: an approximate LRU of two generations. Entries go into
    the young one; once it holds half the budget it becomes the old one (the previous old one is
    dropped), and a hit in the old one moves back into the young one. A hit in the young one, a
    tenant seen lately, is one dict lookup: moving every hit to the end of one ordered dict took
    a pop and an insert per request."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.young: dict[tuple[str, int, bytes], tuple[int, tuple[int, ...], bytes]] = {}
        self.old: dict[tuple[str, int, bytes], tuple[int, tuple[int, ...], bytes]] = {}
        self.used = 0  # bytes of system text in `young`
        self.old_used = 0  # ... in `old`

    def get(self, key: tuple[str, int, bytes]) -> tuple[int, tuple[int, ...], bytes] | None:
        found = self.young.get(key)
        if found is None:
            found = self.old.pop(key, None)
            if found is not None:
                self.old_used -= len(key[2])
                self._add(key, found)
        return found

    def put(self, key: tuple[str, int, bytes], value: tuple[int, tuple[int, ...], bytes]) -> None:
        if len(key[2]) > self.budget // 16:  # a huge system part is hashed per request instead
            return
        self._add(key, value)

    def _add(self, key: tuple[str, int, bytes], value: tuple[int, tuple[int, ...], bytes]) -> None:
        size = len(key[2])
        if self.used + size > self.budget // 2:
            self.old, self.old_used = self.young, self.used
            self.young, self.used = {}, 0
        self.young[key] = value
        self.used += size


_system_hashes = _SystemHashes(_SYSTEM_CACHE_BYTES)
_seeds: Final[dict[str, tuple[bytes, bytes]]] = {}  # seed -> (its encoding, the hash that starts its chains)


def _seeded(seed: str) -> tuple[bytes, bytes]:
    found = _seeds.get(seed)
    if found is None:
        if len(_seeds) >= _SEEDS:
            _seeds.clear()
        head = seed.encode() + b"\x00"
        found = _seeds[seed] = (head, _h(head).to_bytes(8, "little"))
    return found


def prefix_key(endpoint_is_chat: bool, data: dict[str, Any], seed: str, block: int, max_blocks: int) -> PrefixKey:
    if endpoint_is_chat:
        text, system_end = render_chat(data)
    else:
        text, system_end = render_prompt(data.get("prompt")), 0
    blocks = len(text) // block
    if max_blocks < blocks:  # (min without the call: this runs on every request)
        blocks = max_blocks
    cache_key: tuple[str, int, bytes] | None = None
    known: tuple[int, tuple[int, ...], bytes] | None = None
    if system_end > 0:
        pin_part = text[:system_end]
        cache_key = (seed, block, pin_part)
        known = _system_hashes.get(cache_key)
    else:
        pin_part = text[:block]
    if known is None:
        head, first = _seeded(seed)
        known = _chain(_h(head + pin_part), (), first, pin_part, min(len(pin_part) // block, max_blocks), block)
        if cache_key is not None:
            _system_hashes.put(cache_key, known)
    pin, chain, previous = known
    if blocks > len(chain):
        pin, chain, previous = _chain(pin, chain, previous, text, blocks, block)
    elif blocks < len(chain):  # kept by a policy hashing more blocks
        chain = chain[:blocks]
    pin_blocks = system_end // block
    return _new_key(PrefixKey, (pin, chain, pin_blocks if pin_blocks <= len(chain) else len(chain)))


def _chain(pin: int, chain: tuple[int, ...], previous: bytes, text: bytes, blocks: int, block: int):
    """Extend `chain` (hashes of text's first len(chain) blocks, the last one `previous`) to `blocks`."""
    if blocks <= len(chain):
        return pin, chain, previous
    out = list(chain)
    # per block, _h(previous + the block) without copying either (a long prompt has dozens)
    view = memoryview(text)
    copy, from_bytes = _BLAKE8.copy, int.from_bytes
    for start in range(len(chain) * block, blocks * block, block):
        h = copy()
        h.update(previous)
        h.update(view[start : start + block])
        previous = h.digest()
        out.append(from_bytes(previous, "little"))
    return pin, tuple(out), previous
