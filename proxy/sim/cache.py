"""vLLM-style automatic prefix cache: chained hashes over full token blocks, LRU, fixed budget.

Block i's hash covers (hash of block i-1, tokens of block i), seeded with the model or adapter
name, so a hit on block i implies hits on all blocks before it, as in vLLM.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict


class PrefixCache:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    @staticmethod
    def seed(name: str) -> int:
        return zlib.crc32(name.encode())

    def chain(self, tokens: list[int], parent: int, start: int = 0) -> list[int]:
        """Hashes of the full blocks of tokens[start:], chained from `parent`."""
        bs = self.block_size
        hashes = []
        for i in range(start, len(tokens) - bs + 1, bs):
            parent = hash((parent, *tokens[i:i + bs]))
            hashes.append(parent)
        return hashes

    def lookup(self, hashes: list[int], prompt_len: int) -> int:
        """Leading prompt tokens already cached. Like vLLM, the last prompt token is always
        recomputed, so a fully cached prompt reports one block less."""
        blocks = self._blocks
        limit = min(len(hashes), (prompt_len - 1) // self.block_size)
        hit = 0
        while hit < limit and hashes[hit] in blocks:
            blocks.move_to_end(hashes[hit])
            hit += 1
        return hit * self.block_size

    def insert(self, hashes: list[int]) -> None:
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.num_blocks:
            blocks.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)
