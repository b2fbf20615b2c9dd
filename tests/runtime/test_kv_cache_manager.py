import collections

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtopt.runtime.block_pool import BlockPool
from trtopt.runtime.kv_cache_manager import KVCacheManager


class FakeCache:
    """Slot -> token id contents, so tests can check what each block table reads back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots = [None] * (num_blocks * block_size)
        self.copies: list[tuple[int, int]] = []

    def copy_blocks(self, pairs):
        for src, dst in pairs:
            self.slots[dst * self.bs : (dst + 1) * self.bs] = self.slots[src * self.bs : (src + 1) * self.bs]
            self.copies.append((src, dst))

    def write(self, table, token_ids, start, end):
        for p in range(start, end):
            self.slots[table[p // self.bs] * self.bs + p % self.bs] = token_ids[p]

    def read(self, table, n):
        return [self.slots[table[p // self.bs] * self.bs + p % self.bs] for p in range(n)]


def make(num_blocks=8, block_size=4, prefix=True):
    pool = BlockPool(num_blocks, block_size, prefix)
    cache = FakeCache(num_blocks, block_size)
    return pool, KVCacheManager(pool, copy_blocks=cache.copy_blocks), cache


def test_allocate_and_append_exact_block_ids():
    pool, kv, _ = make()
    toks = list(range(100, 110))
    assert kv.allocate_slots("a", toks, 0, 6) == [1, 2]  # 6 tokens -> 2 blocks of 4
    assert kv.allocate_slots("a", toks, 6, 2) == []  # fills block 2 exactly: no new block
    assert kv.allocate_slots("a", toks, 8, 1) == [3]  # token 9 starts a third block
    assert kv.block_ids("a") == [1, 2, 3]
    assert kv.allocate_slots("b", [7] * 5, 0, 5) == [4, 5]
    kv.free("a")
    assert pool.num_free_blocks == 5 and kv.block_ids("a") == []
    pool.check_invariants()


def test_allocate_returns_none_and_changes_nothing_when_full():
    pool, kv, _ = make(num_blocks=4)
    kv.allocate_slots("a", [1] * 8, 0, 8)
    assert kv.allocate_slots("b", [2] * 8, 0, 8) is None
    assert kv.block_ids("b") == [] and pool.num_free_blocks == 1
    pool.check_invariants()


def test_prefix_hit_reuses_the_same_blocks_and_skips_them():
    pool, kv, _ = make()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    kv.allocate_slots("a", prompt, 0, 10)  # blocks [1, 2, 3]; 1 and 2 full -> cached
    kv.free("a")
    hits, n = kv.get_computed_blocks(prompt[:9] + [99])
    assert hits == [1, 2] and n == 8
    # Block 3 (partial, uncached) went to the front of the free queue, so it is reused first.
    assert kv.allocate_slots("b", prompt[:9] + [99], 8, 2, hits) == [3]
    assert kv.block_ids("b") == [1, 2, 3]
    assert pool.ref_cnt[1] == pool.ref_cnt[2] == 1
    # A different first block shares nothing, even if later blocks are equal.
    assert kv.get_computed_blocks([0, 2, 3, 4, 5, 6, 7, 8, 9])[0] == []


def test_last_prompt_token_is_never_a_cache_hit():
    _, kv, _ = make()
    prompt = list(range(8))  # exactly 2 full blocks
    kv.allocate_slots("a", prompt, 0, 8)
    hits, n = kv.get_computed_blocks(prompt)
    assert hits == [1] and n == 4  # the second block holds the last token, whose logits are needed


def test_revived_free_cached_blocks_count_against_free_blocks():
    pool, kv, _ = make(num_blocks=4, block_size=2)  # 3 usable
    prompt = [1, 2, 3, 4, 5]
    kv.allocate_slots("a", prompt, 0, 5)  # [1, 2, 3]
    kv.free("a")  # all free, 1 and 2 cached
    hits, n = kv.get_computed_blocks(prompt)
    assert hits == [1, 2] and n == 4
    # Needs 1 fresh block + reviving 2 free ones = 3 <= 3 free.
    assert kv.allocate_slots("b", prompt, n, 1, hits) == [3]
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_fork_shares_blocks_and_first_write_copies():
    pool, kv, cache = make()
    prompt = [11, 12, 13, 14, 15, 16]
    kv.allocate_slots("p", prompt, 0, 6)  # [1, 2]
    cache.write(kv.block_ids("p"), prompt, 0, 6)
    kv.fork("p", "c")
    assert kv.block_ids("c") == [1, 2] and pool.ref_cnt[1] == pool.ref_cnt[2] == 2
    # The child rewrites position 5 (in shared block 2): block 2 is copied to a fresh block 3 first.
    assert kv.allocate_slots("c", prompt, 5, 1) == [3]
    assert cache.copies == [(2, 3)]
    assert kv.block_ids("c") == [1, 3] and pool.ref_cnt[2] == 1 and pool.ref_cnt[1] == 2
    # The parent's next token goes to its own, now unshared, block 2: no copy.
    assert kv.allocate_slots("p", prompt + [17], 6, 1) == []
    assert cache.copies == [(2, 3)]
    assert cache.read(kv.block_ids("c"), 5) == prompt[:5]
    kv.free("p")
    kv.free("c")
    assert pool.num_free_blocks == pool.num_usable_blocks
    pool.check_invariants()


# ---- property test: random operations never leak, double free, or corrupt what a table reads --------------

OPS = st.lists(
    st.tuples(st.sampled_from(["new", "new", "append", "append", "append", "fork", "free", "abort", "evict"]), st.integers(0, 10**6)),
    min_size=150,
    max_size=250,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, prefix=st.booleans())
def test_random_operations_keep_the_pool_consistent(ops, prefix):
    import random

    bs = 4
    pool, kv, cache = make(num_blocks=24, block_size=bs, prefix=prefix)
    seqs: dict[str, tuple[list[int], int]] = {}  # id -> (token ids, num computed)
    handed_out: list[tuple[list[int], list[int]]] = []  # (a list block_ids returned, its contents then)
    next_id = 0
    for op, arg in ops:
        rnd = random.Random(arg)
        ids = sorted(seqs)
        if op == "new" or op == "evict":
            # Small alphabet and shared starts make prefix hits common; "evict" asks for a lot of blocks.
            length = rnd.randint(1, 40 if op == "evict" else 14)
            toks = [rnd.randint(0, 2) for _ in range(length)]
            rid = f"r{next_id}"
            next_id += 1
            hits, n = kv.get_computed_blocks(toks)
            if kv.allocate_slots(rid, toks, n, len(toks) - n, hits) is not None:
                cache.write(kv.block_ids(rid), toks, n, len(toks))
                seqs[rid] = (toks, len(toks))
        elif op == "append" and ids:
            rid = rnd.choice(ids)
            toks, n = seqs[rid]
            k = rnd.randint(1, 6)
            toks = toks + [rnd.randint(0, 2) for _ in range(k)]
            lookahead = rnd.choice([0, 0, rnd.randint(1, 6)])  # draft slots, rolled back at once (truncate)
            if kv.allocate_slots(rid, toks, n, k, num_lookahead_tokens=lookahead) is not None:
                cache.write(kv.block_ids(rid), toks, n, n + k)
                if lookahead:
                    handed_out.append((kv.block_ids(rid), list(kv.block_ids(rid))))
                    kv.truncate(rid, n + k)
                seqs[rid] = (toks, n + k)
        elif op == "fork" and ids:
            parent = rnd.choice(ids)
            rid = f"r{next_id}"
            next_id += 1
            kv.fork(parent, rid)
            seqs[rid] = seqs[parent]
        elif op in ("free", "abort") and ids:
            rid = rnd.choice(ids)
            kv.free(rid)
            del seqs[rid]
        check_consistent(pool, kv, cache, seqs)
        # A table handed out is never changed afterwards (InputBuilder caches what it derives from it by identity).
        for table, was in handed_out:
            assert table == was, "a block-id list handed out was mutated"
        handed_out += [(t, list(t)) for t in (kv.block_ids(r) for r in seqs)]
    for rid in list(seqs):
        kv.free(rid)
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(r == 0 for r in pool.ref_cnt)
    pool.check_invariants()


def check_consistent(pool, kv, cache, seqs):
    pool.check_invariants()
    holders = collections.Counter(b for table in kv.holders().values() for b in table)
    for b in range(1, pool.num_blocks):
        assert pool.ref_cnt[b] == holders[b], f"block {b}: ref {pool.ref_cnt[b]} but {holders[b]} holders"
    assert set(kv.holders()) == set(seqs)
    for rid, (toks, n) in seqs.items():
        table = kv.block_ids(rid)
        assert len(set(table)) == len(table), f"{rid} holds a block twice"
        assert len(table) * pool.block_size >= n
        assert cache.read(table, n) == toks[:n], f"{rid} reads back the wrong tokens"
