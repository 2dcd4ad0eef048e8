"""Chained block hashes per cluster, exact whole-prompt hits, bounded LRU memory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prfaas_router.prefix_index import NO_HIT, PrefixIndex, key_for_text, key_for_tokens

B = 4  # block size in tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_block_hashes_are_chained_to_their_prefix() -> None:
    a = key_for_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9], B)
    b = key_for_tokens([0, 2, 3, 4, 5, 6, 7, 8], B)
    assert len(a.block_hashes) == 2 and a.tokens == 9
    # the second block's tokens are equal, but its hash covers the first block too
    assert a.block_hashes[1] != b.block_hashes[1]


def test_a_lookup_hashes_no_further_than_the_first_block_a_cluster_lacks() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=100)
    index.learn(key_for_tokens(list(range(8)), B), "p0")
    # block 3 holds an array: hashing it would raise, so a lookup that reached it would fail
    held_then_fresh = key_for_tokens([*range(4), 9, 9, 9, 9, 1, [2], 3, 4], B)  # type: ignore[list-item]
    assert index.lookup(held_then_fresh).tokens == 4
    with pytest.raises(TypeError):  # learning needs every block
        index.learn(held_then_fresh, "p0")
    assert index.lookup(key_for_tokens(list(range(8)), B)).exact  # a failed learn changed nothing


def test_lookup_counts_whole_leading_blocks_only() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=100)
    index.learn(key_for_tokens(list(range(12)), B), "p0")
    assert index.lookup(key_for_tokens([*range(10), 99, 98], B)).tokens == 8  # diverges in block 3
    assert index.lookup(key_for_tokens([*range(3), 99, *range(4, 12)], B)) == NO_HIT


def test_a_whole_prompt_seen_before_is_an_exact_hit_and_a_longer_one_is_not() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=100)
    prompt = list(range(10))
    index.learn(key_for_tokens(prompt, B), "l1")
    same = index.lookup(key_for_tokens(prompt, B))
    assert (same.tokens, same.exact, same.holder) == (10, True, "l1")
    longer = index.lookup(key_for_tokens([*prompt, 10, 11], B))
    assert (longer.tokens, longer.exact) == (8, False)  # blocks only: the linear state is not reusable


def test_the_holder_of_the_deepest_block_is_reported_and_none_does_not_overwrite_it() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=100)
    index.learn(key_for_tokens(list(range(8)), B), "l0")
    index.learn(key_for_tokens(list(range(16)), B), None)
    found = index.lookup(key_for_tokens([*range(16), 1], B))
    assert found.tokens == 16 and found.holder == "l0"  # the blocks l0 computed keep their holder
    assert index.lookup(key_for_tokens([*range(8), 5], B)).holder == "l0"


def test_memory_is_bounded_and_tails_are_evicted_before_their_prefixes() -> None:
    index = PrefixIndex(max_blocks=6, max_prompts=2)
    index.learn(key_for_tokens(list(range(16)), B), "a")  # 4 blocks
    index.learn(key_for_tokens(list(range(100, 116)), B), "b")  # 4 more: 2 of the first evicted
    assert len(index) == 6
    first = index.lookup(key_for_tokens(list(range(16)), B))
    assert (first.tokens, first.exact) == (8, False)  # its two leading blocks survive, not the tail
    assert index.lookup(key_for_tokens(list(range(100, 116)), B)).exact


def test_text_blocks_use_the_calibrated_characters_per_token() -> None:
    key = key_for_text("x" * 100, block_size_tokens=4, chars_per_token=2.5)
    assert len(key.block_hashes) == 10 and key.tokens == 40 and key.block_tokens == 4
    index = PrefixIndex(max_blocks=100, max_prompts=10)
    index.learn(key, None)
    assert index.lookup(key_for_text("x" * 95 + "y" * 20, 4, 2.5)).tokens == 36


def test_text_and_token_keys_never_share_blocks() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=10)
    index.learn(key_for_text("abcdabcd", 4, 1.0), None)
    assert index.lookup(key_for_tokens([97, 98, 99, 100, 97, 98, 99, 100], 4)) == NO_HIT


def test_lookup_all_adds_up_a_batch() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=10)
    index.learn(key_for_tokens(list(range(8)), B), "p0")
    keys = [key_for_tokens([*range(8), 1], B), key_for_tokens(list(range(8)), B), key_for_tokens([7] * 9, B)]
    total = index.lookup_all(keys)
    assert (total.tokens, total.exact, total.holder) == (16, False, "p0")


def test_capacities_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        PrefixIndex(max_blocks=0, max_prompts=1)


@given(
    a=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    b=st.lists(st.integers(0, 3), min_size=1, max_size=40),
)
def test_a_hit_is_the_common_prefix_rounded_down_to_blocks(a: list[int], b: list[int]) -> None:
    index = PrefixIndex(max_blocks=1000, max_prompts=1000)
    index.learn(key_for_tokens(a, B), "x")
    found = index.lookup(key_for_tokens(b, B))
    if a == b:
        assert found.exact and found.tokens == len(b)
    else:
        assert not found.exact
        assert found.tokens == (common_prefix(a, b) // B) * B
        assert found.tokens <= len(b)


@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=30), min_size=1, max_size=30))
def test_the_index_never_outgrows_its_bounds(prompts: list[list[int]]) -> None:
    index = PrefixIndex(max_blocks=7, max_prompts=3)
    for prompt in prompts:
        index.learn(key_for_tokens(prompt, B), None)
        assert len(index) <= 7
