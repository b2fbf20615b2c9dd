"""KVCacheManager: which physical blocks each request's tokens live in (docs/architecture.md §6).

It maps request id -> block ids (the block table) and does four things: allocate slots for new tokens
(None when the pool cannot, so the scheduler preempts), append (allocating one more token is the same
call), fork (n>1: the child shares every block, copy-on-write), and free. Prefix caching: full blocks are
registered in the BlockPool under their chained hash as soon as they are scheduled, and a new request
takes over the longest cached prefix instead of computing it.
"""

from __future__ import annotations

from typing import Callable, Sequence

from trtopt.runtime.block_pool import BlockHash, BlockPool, hash_block

CopyBlocksFn = Callable[[list[tuple[int, int]]], None]  # the executor's copy_blocks: (src, dst) pairs


class KVCacheManager:
    def __init__(self, pool: BlockPool, copy_blocks: CopyBlocksFn) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._copy_blocks = copy_blocks
        self._blocks: dict[str, list[int]] = {}  # request id -> block table (logical order)
        self._hashes: dict[str, list[BlockHash]] = {}  # request id -> hashes of its leading full blocks
        self.num_cow_copies = 0

    # ---- queries -------------------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table. Do not mutate it; nor does the manager: every change to a table makes a new
        list, so a list handed out stays what it was, and a caller may cache what it derives from it by identity
        (InputBuilder does)."""
        return self._blocks.get(request_id, [])

    def holders(self) -> dict[str, list[int]]:
        """Every request's block table; tests compare it with the pool's ref counts."""
        return self._blocks

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, as (block ids, tokens covered).

        The last token is never served from the cache: its logits are needed, so it must be computed.
        """
        if not self.pool.enable_prefix_cache:
            return [], 0
        hits: list[int] = []
        parent: BlockHash | None = None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * bs

    # ---- mutations -----------------------------------------------------------------------------------

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for the K/V of tokens [num_computed, num_computed + num_new) of `token_ids`.

        `cached_blocks` are prefix hits from get_computed_blocks, given on a request's first allocation
        (num_computed_tokens then already counts them). A block that will be written but is shared with
        another sequence is copied first (copy-on-write). All or nothing: returns the newly taken block
        ids, or None (and changes nothing) when the pool has too few free blocks.

        `num_lookahead_tokens` more slots are made after them for draft tokens (speculative decoding): they are
        written and copied-on-write like the others, but never hashed into the prefix cache, since only committed
        tokens may be. `truncate` gives back what the rejected ones did not need.
        """
        assert num_new_tokens >= 1, f"allocate_slots needs >= 1 new token, got {num_new_tokens}"
        assert len(token_ids) >= num_computed_tokens + num_new_tokens, "token ids must cover the tokens to compute"
        table = self._blocks.get(request_id, [])
        assert not (cached_blocks and table), f"{request_id}: prefix hits can only seed an empty block table"
        bs = self.block_size
        end = num_computed_tokens + num_new_tokens
        num_required = -(-(end + num_lookahead_tokens) // bs)
        ref_cnt, first = self.pool.ref_cnt, num_computed_tokens // bs
        if num_required <= len(table) and (ref_cnt[table[first]] == 1 if num_required == first + 1
                                           else all(ref_cnt[table[i]] == 1 for i in range(first, num_required))):
            # Most decode steps: the tokens fit in blocks this sequence already holds alone (cached_blocks is
            # then empty, by the assert above). Nothing is taken or copied and the table stays the same list.
            self._cache_full_blocks(request_id, token_ids, end)
            return []
        num_fresh = max(0, num_required - len(table) - len(cached_blocks))
        # Blocks that receive writes this step and that another sequence also holds.
        cow = [i for i in range(first, min(len(table), num_required)) if ref_cnt[table[i]] > 1]
        # Touching a free cached block takes it off the free queue, so it counts against the free blocks.
        num_revived = sum(self.pool.is_free(b) for b in cached_blocks)
        if num_fresh + len(cow) + num_revived > self.pool.num_free_blocks:
            return None

        self.pool.touch(cached_blocks)  # before get_new_blocks, so the hits cannot be evicted by it
        new_blocks = self.pool.get_new_blocks(num_fresh + len(cow))
        assert new_blocks is not None, "the free-block check above guarantees the allocation"
        table = list(cached_blocks) + table
        self._copy_on_write(table, cow, new_blocks[num_fresh:])
        table.extend(new_blocks[:num_fresh])
        self._blocks[request_id] = table
        self._cache_full_blocks(request_id, token_ids, end)
        return new_blocks

    def _copy_on_write(self, table: list[int], indices: list[int], fresh: list[int]) -> None:
        if not indices:
            return
        pairs = [(table[i], dst) for i, dst in zip(indices, fresh)]
        self._copy_blocks(pairs)
        self.pool.free_blocks(src for src, _ in pairs)  # drop our hold on the shared originals
        for i, dst in zip(indices, fresh):
            table[i] = dst
        self.num_cow_copies += len(pairs)

    def _cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Register the blocks that are full once `num_tokens` tokens are computed."""
        if not self.pool.enable_prefix_cache:
            return
        hashes = self._hashes.setdefault(request_id, [])
        table = self._blocks[request_id]
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            block = token_ids[i * bs : (i + 1) * bs]
            if block[-1] < 0:
                break  # async scheduling: its last token is a placeholder; the block is hashed once the token is known
            block_hash = hash_block(parent, block)
            hashes.append(block_hash)
            self.pool.cache_block(table[i], block_hash)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Speculative-decoding rollback: keep only the blocks that hold the first `num_tokens` tokens.

        Blocks past them held nothing but rejected draft tokens (or unused lookahead slots): they go back to the
        pool, tail first. Rejected tokens left in the last kept block sit past the sequence's length, where the
        next step overwrites them. None of this can touch a shared or prefix-cached block: draft slots were
        copied-on-write when allocated, and blocks are hashed only up to committed tokens.
        """
        table = self._blocks[request_id]
        keep = -(-num_tokens // self.block_size)
        assert len(self._hashes.get(request_id, ())) <= keep, f"{request_id}: a hashed block would be rolled back"
        if keep < len(table):
            self.pool.free_blocks(reversed(table[keep:]))
            self._blocks[request_id] = table[:keep]  # a new list: the one handed out stays as it was

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give child_id the same blocks as parent_id (ref count + 1 each); the first write copies (COW)."""
        assert child_id not in self._blocks, f"{child_id} already holds blocks"
        table = self._blocks[parent_id]
        self.pool.touch(table)
        self._blocks[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))

    def free(self, request_id: str) -> None:
        """Drop every block of the request (tail first, so the tail is evicted first). Idempotent."""
        table = self._blocks.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self.pool.free_blocks(reversed(table))
