"""Which replica served which prompt prefixes: the prefix router's memory (Ray-free).

A prompt's text is cut into blocks of `block_chars` characters and each block named by a
hash chained over all the blocks before it, as the engine's prefix cache names token
blocks: two prompts share the first k hashes exactly when they share their first k blocks.
Each replica keeps the hashes of the prompts sent to it, least recently used evicted first,
so the index stays bounded whatever the traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

# Characters per block: about one 16-token KV block of English text.
DEFAULT_BLOCK_CHARS = 64
# Blocks remembered per replica (64 chars each: ~6 MB of prompt text per replica).
DEFAULT_MAX_BLOCKS = 100_000


class PrefixIndex:
    """Per replica, the chained block hashes of the prompts routed to it (an LRU)."""

    def __init__(self, block_chars: int = DEFAULT_BLOCK_CHARS,
                 max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS) -> None:
        if block_chars < 1 or max_blocks_per_replica < 1:
            raise ValueError("block_chars and max_blocks_per_replica must be >= 1")
        self.block_chars = block_chars
        self.max_blocks = max_blocks_per_replica
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def _hashes(self, text: str) -> list[int]:
        hashes, chained = [], 0
        for start in range(0, len(text) - self.block_chars + 1, self.block_chars):
            chained = hash((chained, text[start:start + self.block_chars]))
            hashes.append(chained)
        return hashes

    def insert(self, replica: str, text: str) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in self._hashes(text):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def longest_match(self, text: str, replicas: Iterable[str]) -> tuple[str | None, int]:
        """(the replica holding the longest prefix of `text`, its length in characters);
        (None, 0) when no replica holds even the first block."""
        hashes = self._hashes(text)
        best, best_blocks = None, 0
        for replica in replicas:
            blocks = self._blocks.get(replica)
            if not blocks:
                continue
            matched = 0
            while matched < len(hashes) and hashes[matched] in blocks:
                matched += 1
            if matched > best_blocks:
                best, best_blocks = replica, matched
        return best, best_blocks * self.block_chars

    def remove(self, replica: str) -> None:
        self._blocks.pop(replica, None)

    def replicas(self) -> list[str]:
        return list(self._blocks)
