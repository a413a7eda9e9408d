"""Physical KV blocks: free queue, reference counts, and the prefix cache of full blocks.

Invariants (``check_integrity``):
- a block is either referenced (ref_count > 0) or in the free queue, never both;
- a block in the hash map holds exactly the tokens its key names (its KV is valid);
- free blocks that are cached stay reusable until evicted, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockHash:
    """Key of a full block: chained over the parent's hash, so equal keys mean equal prefixes.

    ``token_ids`` rides along so a hit compares tokens, and a hash collision can never hand a
    request the wrong KV.
    """

    value: int
    token_ids: tuple[int, ...]


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    tokens = tuple(token_ids)
    return BlockHash(hash((parent.value if parent else None, tokens)), tokens)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set once the block is full, computed and registered
    generation: int = 0  # bumped each time the block gets new content
    # (block id, generation) of the block before it in the sequence that registered it
    parent: tuple[int, int] | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found
    evictions: int = 0  # cached blocks reused for new content


class BlockPool:
    """Owns ``num_blocks`` physical blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (least recently freed first); O(1) removal on a hit.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # hash value -> block id
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced blocks count)."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the free queue, evicting their cached contents."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.generation += 1  # children cached under its old content no longer match
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash.value) == block.block_id:
            del self._cached[block.block_hash.value]
        block.block_hash = None
        self.stats.evictions += 1

    def lookup(self, block_hash: BlockHash, parent_block: int | None) -> int | None:
        """The cached block holding exactly these tokens right after ``parent_block`` (the
        block matched for the previous position; None for the first block), if any.

        A hit needs equal tokens and the very same parent block (same content generation),
        so by induction the whole prefix is equal: a hash collision is a miss, never a
        wrong hit.
        """
        block_id = self._cached.get(block_hash.value)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.block_hash != block_hash or block.parent != self._identity(parent_block):
            return None
        return block_id

    def _identity(self, block_id: int | None) -> tuple[int, int] | None:
        return None if block_id is None else (block_id, self.blocks[block_id].generation)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (removing them from the free queue if idle)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def register(self, block_id: int, block_hash: BlockHash, parent_block: int | None) -> None:
        """Publish a full, computed block for prefix reuse (first writer wins on duplicates)."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.parent = self._identity(self._published_twin(parent_block))
        self._cached.setdefault(block_hash.value, block_id)

    def _published_twin(self, block_id: int | None) -> int | None:
        """The block the hash map holds for ``block_id``'s prefix: ``block_id`` itself, or
        the twin published before it when ``block_id`` is a duplicate (two requests computed
        the same block in one step; first writer wins). A child is registered under the
        published one, which lookups walk through: under the duplicate, no later prompt could
        match it, nor register its own copy (its hash taken), until the child was evicted."""
        if block_id is None or (own := self.blocks[block_id].block_hash) is None:
            return block_id
        twin = self._cached.get(own.value)
        if twin is None or twin == block_id:
            return block_id
        other = self.blocks[twin]  # same tokens after the same parent: the same prefix
        same = other.block_hash == own and other.parent == self.blocks[block_id].parent
        return twin if same else block_id

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; a block reaching zero joins the free queue.

        Callers pass a request's blocks last first, so a sequence's tail is evicted before
        its (more shareable) head.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Uncached blocks are worthless: hand them out first.
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None

    def cached_free_blocks(self) -> list[int]:
        """Free blocks that still hold a registered prefix (a later prompt may hit them)."""
        return [b for b in self._free if self.blocks[b].block_hash is not None]

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._free):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)

    def check_integrity(self) -> None:
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert (block.ref_count == 0) == in_free, f"block {block.block_id} ref/free mismatch"
            assert block.ref_count >= 0
        for value, block_id in self._cached.items():
            cached = self.blocks[block_id].block_hash
            assert cached is not None and cached.value == value
