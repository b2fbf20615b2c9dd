"""BlockPool: the only owner of physical KV blocks (docs/architecture.md §6; vLLM v1 block_pool.py is the model).

It owns three things and nobody else touches them:
- the free queue, in eviction order (least recently freed first);
- a ref count per block (how many sequences' block tables hold it);
- the prefix cache: hash of a full block (parent hash + its token ids) -> block id.

A freed block keeps its hash and stays findable until it is handed out again, so a later request with
the same prefix can take it back ("touch") instead of recomputing it. Block 0 is the null block: it is
never handed out and pads block tables (docs/architecture.md §3).
"""

from __future__ import annotations

import collections
import hashlib
import struct
from typing import Iterable, Sequence

NULL_BLOCK = 0

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of a full block, chained on its parent so equal blocks at different prefixes differ."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        assert num_blocks >= 2, f"need the null block plus at least one usable block, got num_blocks={num_blocks}"
        assert block_size >= 1, f"block_size must be >= 1, got {block_size}"
        self.num_blocks = num_blocks  # including the null block
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # OrderedDict as an O(1) LRU queue: the front is evicted first, touch() removes from the middle.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict((b, None) for b in range(1, num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0  # cached blocks whose hash was dropped to reuse them

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not: all of them can be handed out."""
        return len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def get_new_blocks(self, n: int) -> list[int] | None:
        """Take n blocks with ref count 1, evicting the least recently freed cached ones. None if < n are free."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._drop_hash(block_id)
            assert self.ref_cnt[block_id] == 0, f"block {block_id} was on the free queue with ref {self.ref_cnt[block_id]}"
            self.ref_cnt[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block (a prefix-cache hit or a fork); a free cached block leaves the free queue."""
        for block_id in block_ids:
            assert block_id != NULL_BLOCK, "the null block is never held"
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block. Pass a sequence's blocks tail first: tails are evicted first."""
        for block_id in block_ids:
            assert block_id != NULL_BLOCK, "the null block is never held"
            assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                if self.block_hash[block_id] is None:
                    # Nothing to reuse in it: put it at the front so cached blocks survive longer.
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Register a full, computed block under its hash. A hash that already has a block keeps that one."""
        if not self.enable_prefix_cache or block_hash in self._cached:
            return
        assert self.ref_cnt[block_id] > 0, f"caching block {block_id}, which nobody holds"
        assert self.block_hash[block_id] is None, f"block {block_id} is already cached"
        self._cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash) if self.enable_prefix_cache else None

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after a failed step left block contents unknown)."""
        for block_id in list(self._cached.values()):
            self.block_hash[block_id] = None
        self._cached.clear()

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hash[block_id] = None
            self.num_evictions += 1

    def check_invariants(self) -> None:
        """Assert the pool is self-consistent (used by tests and after failed steps)."""
        assert self.ref_cnt[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free, "the null block was handed out"
        for block_id in range(1, self.num_blocks):
            free = block_id in self._free
            assert free == (self.ref_cnt[block_id] == 0), f"block {block_id}: ref {self.ref_cnt[block_id]} but free={free}"
        for block_hash, block_id in self._cached.items():
            assert self.block_hash[block_id] == block_hash, f"block {block_id} lost its hash"
        assert sum(h is not None for h in self.block_hash) == len(self._cached), "hash map and block hashes disagree"
