"""Prefix KV cache model: hits, pinning, LRU eviction, capacity, cached output."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.model.cache import PrefixCache, chain_block_ids, model_seed, text_block_hashes

BS = 16


def blocks(*ids: int) -> list[int]:
    return list(ids)


def test_second_identical_prompt_hits_and_counts_tokens() -> None:
    cache = PrefixCache(num_blocks=100, block_size_tokens=BS)
    prompt = [1, 2, 3, 4]
    first = cache.allocate("a", prompt, num_tokens=70)
    assert first is not None and first.hit_blocks == 0
    cache.free("a")
    second = cache.allocate("b", prompt, num_tokens=70)
    assert second is not None
    assert second.hit_blocks == 4 and second.hit_tokens == 64
    assert cache.queries_tokens == 140
    assert cache.hits_tokens == 64


def test_last_prompt_token_is_always_recomputed() -> None:
    cache = PrefixCache(num_blocks=100, block_size_tokens=BS)
    cache.allocate("a", [1, 2], num_tokens=32)
    cache.free("a")
    again = cache.allocate("b", [1, 2], num_tokens=32)
    assert again is not None and again.hit_blocks == 1


def test_hits_stop_at_first_missing_block() -> None:
    cache = PrefixCache(num_blocks=100, block_size_tokens=BS)
    cache.allocate("a", [1, 2, 3], num_tokens=60)
    cache.free("a")
    alloc = cache.allocate("b", [1, 2, 9, 3], num_tokens=80)
    assert alloc is not None and alloc.hit_blocks == 2


def test_lru_evicts_least_recently_freed_request_first() -> None:
    cache = PrefixCache(num_blocks=8, block_size_tokens=BS)
    cache.allocate("old", [1, 2, 3, 4], num_tokens=64)
    cache.free("old")
    cache.allocate("new", [5, 6, 7, 8], num_tokens=64)
    cache.free("new")
    alloc = cache.allocate("c", [9, 10], num_tokens=32)
    assert alloc is not None and alloc.evicted_blocks == 2
    assert cache.contains_prefix([5, 6, 7, 8]) == 4
    assert cache.contains_prefix([1, 2, 3, 4]) == 2  # the tail of "old" went first


def test_hit_refreshes_recency() -> None:
    cache = PrefixCache(num_blocks=4, block_size_tokens=BS)
    cache.allocate("a", [1, 2], num_tokens=32)
    cache.free("a")
    cache.allocate("b", [3, 4], num_tokens=32)
    cache.free("b")
    cache.allocate("a2", [1, 2], num_tokens=40)  # reuse a's blocks, making them recent
    cache.free("a2")
    cache.allocate("c", [5, 6], num_tokens=32)
    assert cache.contains_prefix([1, 2]) == 2
    assert cache.contains_prefix([3, 4]) == 0


def test_running_blocks_are_never_evicted() -> None:
    cache = PrefixCache(num_blocks=6, block_size_tokens=BS)
    assert cache.allocate("run", [1, 2, 3, 4], num_tokens=64) is not None
    assert cache.allocate("big", [5, 6, 7], num_tokens=48) is None
    assert cache.contains_prefix([1, 2, 3, 4]) == 4
    assert cache.free_blocks == 2 and cache.used_blocks == 4
    assert cache.queries_tokens == 64  # a refused allocation is not a query


def test_shared_prefix_is_pinned_once_and_released_by_last_holder() -> None:
    cache = PrefixCache(num_blocks=10, block_size_tokens=BS)
    cache.allocate("a", [1, 2], num_tokens=40)
    b = cache.allocate("b", [1, 2], num_tokens=40)
    assert b is not None and b.hit_blocks == 2
    assert cache.used_blocks == 2 + 2  # shared blocks once, one partial block each
    cache.free("a")
    assert cache.cached_blocks == 0  # b still pins them
    cache.free("b")
    assert cache.cached_blocks == 2 and cache.used_blocks == 0


def test_reserved_output_counts_as_usage_until_free() -> None:
    cache = PrefixCache(num_blocks=10, block_size_tokens=BS)
    cache.allocate("a", [1], num_tokens=16, reserve_tokens=64)
    assert cache.usage == 0.5
    cache.free("a")
    assert cache.usage == 0.0 and cache.cached_blocks == 1 and cache.free_blocks == 9


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    cache = PrefixCache(num_blocks=20, block_size_tokens=BS)
    seed = model_seed("m")
    prompt = "q" * 100
    answer = "answer! " * 20
    final = text_block_hashes(prompt + answer, BS, seed)
    cache.allocate("t1", text_block_hashes(prompt, BS, seed), num_tokens=25, reserve_tokens=40)
    cache.free("t1", final)
    turn2 = prompt + answer + "and now a follow-up question " * 4
    alloc = cache.allocate("t2", text_block_hashes(turn2, BS, seed), num_tokens=len(turn2) // 4)
    assert alloc is not None and alloc.hit_blocks == len(final) > 1


def test_extend_grows_allocation_within_capacity() -> None:
    cache = PrefixCache(num_blocks=4, block_size_tokens=BS)
    cache.allocate("a", [1], num_tokens=20)
    assert cache.used_blocks == 2
    assert cache.extend("a", 64)
    assert cache.used_blocks == 4
    assert not cache.extend("a", 65)
    assert cache.used_blocks == 4


def test_text_hashes_are_a_chain_over_full_blocks() -> None:
    seed = model_seed("m")
    text = "x" * 64 * 3 + "tail"
    hashes = text_block_hashes(text, BS, seed)
    assert len(hashes) == 3
    assert text_block_hashes(text[:128], BS, seed) == hashes[:2]
    assert text_block_hashes(text, BS, model_seed("other")) != hashes
    # Same content at a different position hashes differently (the parent is the seed).
    assert len(set(hashes)) == 3


def test_non_ascii_text_blocks_by_characters() -> None:
    text = "é" * 64 * 2
    assert len(text_block_hashes(text, BS, 0)) == 2
    assert text_block_hashes(text, BS, 0) != text_block_hashes("e" * 128, BS, 0)


def test_chain_block_ids_depends_on_prefix() -> None:
    assert chain_block_ids([1, 2], 7)[1] != chain_block_ids([3, 2], 7)[1]
    assert chain_block_ids([1, 2], 7)[0] == chain_block_ids([1, 5], 7)[0]


@given(st.text(max_size=400), st.text(max_size=200))
def test_text_hash_prefix_property(a: str, b: str) -> None:
    whole = text_block_hashes(a + b, 4, 1)
    part = text_block_hashes(a, 4, 1)
    assert whole[: len(part)] == part


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "final"]),
        st.integers(0, 5),  # request slot
        st.integers(0, 3),  # prefix family
        st.integers(1, 120),  # prompt tokens
        st.integers(0, 40),  # reserved output tokens
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_capacity_and_pinning_invariants(steps: list[tuple[str, int, int, int, int]]) -> None:
    cache = PrefixCache(num_blocks=24, block_size_tokens=8)
    running: dict[int, list[int]] = {}
    for op, slot, family, tokens, reserve in steps:
        hashes = chain_block_ids(range(tokens // 8), family)
        if op == "alloc" and slot not in running:
            if cache.allocate(slot, hashes, tokens, reserve) is not None:
                running[slot] = hashes
        elif slot in running:
            held = running.pop(slot)
            final = chain_block_ids(range(len(held) + 3), family) if op == "final" else None
            cache.free(slot, final)
        assert cache.used_blocks + cache.cached_blocks + cache.free_blocks == 24
        assert cache.free_blocks >= 0 and cache.used_blocks <= 24
        for held in running.values():
            assert cache.contains_prefix(held) == len(held)
    assert cache.hits_tokens <= cache.queries_tokens
