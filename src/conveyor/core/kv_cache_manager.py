"""Per-request block tables over the block pool.

The scheduler asks three things: which prefix of a new request is already cached, can this
step's tokens be placed (and place them), and free a request. Nothing here touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.core.block_pool import BlockHash, BlockPool, hash_block
from conveyor.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockMap:
    """Who holds which device block now (the web page's block map)."""

    num_blocks: int  # device blocks
    tables: dict[str, tuple[int, ...]]  # request id -> its block table (a copy)
    shared: tuple[int, ...]  # blocks in more than one table (a shared prompt prefix)
    cached: tuple[int, ...]  # free blocks that keep a cached prefix for later prompts


class KVCacheManager:
    """Block tables of live requests, plus host blocks of swapped-out ones.

    ``reserve_tokens`` (the ``kv_allocation="reserve"`` baseline) makes a request's first
    allocation take blocks for that many tokens up front, as contiguous per-slot allocation
    must without knowing the output length; ``None`` allocates blocks on demand (paged).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_swap_blocks: int = 0, reserve_tokens: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.reserve_tokens = reserve_tokens
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[int]] = {}
        self.num_swap_blocks = num_swap_blocks
        self._free_host_blocks = list(range(num_swap_blocks - 1, -1, -1))
        self._released_host_blocks: list[int] = []  # freed by this step's swap-ins
        self._num_registered: dict[str, int] = {}  # request id -> blocks published so far
        self.swapped: dict[str, list[int]] = {}  # request id -> host blocks, in table order
        # Per request: hashes of its full blocks so far (the chain), for registration.
        self._hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of blocks referenced by live requests (0-1)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended incrementally."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start:start + bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks holding a prefix of the request, and how many tokens they cover.

        At least one token is always left to compute: its logits give the next token. A
        request asking for its prompt's logprobs computes all of it.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash, block_ids[-1] if block_ids else None)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry while it waits)."""
        self.pool.stats.queries += num_tokens
        self.pool.stats.hits += num_hit_tokens

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: list[int] | None = None) -> bool:
        return self._num_blocks_to_take(request, num_new_tokens, computed_blocks or []) \
            <= self.pool.num_free_blocks

    def _num_blocks_to_take(self, request: Request, num_tokens: int,
                            computed_blocks: list[int]) -> int:
        table = self.block_tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        new_blocks = self._target_blocks(num_computed + num_tokens) - len(table) \
            - len(computed_blocks)
        # Touching an idle cached block takes it out of the free queue too.
        idle_hits = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_count == 0)
        return max(new_blocks, 0) + idle_hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; None (and no change) if it can't.

        ``computed_blocks`` are prefix-cache hits for a request being admitted; the caller
        then advances ``num_computed_tokens`` past them. ``num_lookahead_tokens`` more tokens
        get blocks now too (a resumed request holds room for its whole recompute).
        """
        computed_blocks = computed_blocks or []
        num_new_tokens += num_lookahead_tokens
        if self._num_blocks_to_take(request, num_new_tokens, computed_blocks) \
                > self.pool.num_free_blocks:
            return None
        table = self.block_tables.setdefault(request.request_id, [])
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self._target_blocks(num_computed + num_new_tokens) - len(table)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return table

    def _target_blocks(self, num_tokens: int) -> int:
        if self.reserve_tokens is not None:
            num_tokens = max(num_tokens, self.reserve_tokens)
        return self.blocks_needed(num_tokens)

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, request: Request) -> bool:
        return len(self.block_tables.get(request.request_id, [])) <= len(self._free_host_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move a request's KV to host blocks; returns (device, host) copies to run."""
        table = self.block_tables.pop(request.request_id)
        self._num_registered.pop(request.request_id, None)
        host = [self._free_host_blocks.pop() for _ in table]
        self.swapped[request.request_id] = host
        self.pool.free(list(reversed(table)))
        return list(zip(table, host, strict=True))

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back with room for ``num_new_tokens`` more; returns the
        (host, device) copies to run, or None (and no change) if blocks are short."""
        host = self.swapped[request.request_id]
        needed = max(self._target_blocks(request.num_computed_tokens + num_new_tokens),
                     len(host))
        if needed > self.pool.num_free_blocks:
            return None
        table = self.pool.allocate(needed)
        self.block_tables[request.request_id] = table
        del self.swapped[request.request_id]
        # The copies run at the next forward pass: a swap-out decided in the same step must
        # not reuse these host blocks before then.
        self._released_host_blocks.extend(host)
        return list(zip(host, table, strict=False))

    def begin_step(self) -> None:
        """Host blocks swapped in during the last step are free again."""
        self._free_host_blocks.extend(self._released_host_blocks)
        self._released_host_blocks.clear()

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose KV is now computed (after a step ran:
        a block is never findable before its content is written)."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        hashes = self._block_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes), len(table))
        start = self._num_registered.get(request.request_id, 0)
        for i in range(start, num_full):
            self.pool.register(table[i], hashes[i], table[i - 1] if i else None)
        self._num_registered[request.request_id] = max(start, num_full)

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's tokens at once: the slots of drafts a
        verification rejected (never published: they hold no verified token)."""
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        keep = max(self._target_blocks(request.num_tokens),
                   self._num_registered.get(request.request_id, 0))
        if len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            self.pool.free(list(reversed(extra)))

    def free(self, request: Request) -> None:
        """Release a request's blocks, last block first (its tail is evicted first)."""
        table = self.block_tables.pop(request.request_id, [])
        self.pool.free(list(reversed(table)))
        self._free_host_blocks.extend(self.swapped.pop(request.request_id, []))
        self._hashes.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)

    def block_map(self) -> BlockMap:
        """A snapshot of the block tables; O(blocks in use + free blocks)."""
        blocks = self.pool.blocks
        tables = {rid: tuple(table) for rid, table in self.block_tables.items()}
        shared = {b for table in tables.values() for b in table if blocks[b].ref_count > 1}
        return BlockMap(self.num_blocks, tables, tuple(sorted(shared)),
                        tuple(self.pool.cached_free_blocks()))

    def num_live_requests(self) -> int:
        return len(self.block_tables)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owned = sum(len(t) for t in self.block_tables.values())
        referenced = sum(b.ref_count for b in self.pool.blocks)
        assert owned == referenced, f"{owned} table entries vs {referenced} references"
        held = sum(len(h) for h in self.swapped.values())
        free = len(self._free_host_blocks) + len(self._released_host_blocks)
        assert held + free == self.num_swap_blocks, "host blocks leaked"
