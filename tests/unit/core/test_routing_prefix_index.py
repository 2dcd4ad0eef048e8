"""Chained block hashes per cluster, exact whole-prompt hits, bounded LRU memory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prfaas_core.routing.prefix_index import (
    NO_HIT,
    POOL_HOLDER,
    ClusterIndexes,
    PrefixIndex,
    PromptKey,
    key_for_text,
    key_for_tokens,
    token_buffer,
)
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS

B = 4  # block size in tokens


def token_key(ids: list[int], block: int = B) -> PromptKey:
    return key_for_tokens(token_buffer(ids), block)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_block_hashes_are_chained_to_their_prefix() -> None:
    a = token_key([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = token_key([0, 2, 3, 4, 5, 6, 7, 8])
    assert len(a.block_hashes) == 2 and a.tokens == 9
    # the second block's tokens are equal, but its hash covers the first block too
    assert a.block_hashes[1] != b.block_hashes[1]


def test_a_lookup_hashes_no_further_than_the_first_block_a_cluster_lacks() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=100)
    index.learn(token_key(list(range(8))), "p0")
    ids = token_buffer([*range(4), 9, 9, 9, 9, 1, 2, 3, 4])
    held_then_fresh = key_for_tokens(ids, B)
    assert index.lookup(held_then_fresh).tokens == 4  # block 0 held, block 1 not: block 2 never hashed
    ids[8] = 7  # so block 2 is hashed from what the buffer holds when the key is learnt
    index.learn(held_then_fresh, "p0")
    assert held_then_fresh.block_hashes == token_key([*range(4), 9, 9, 9, 9, 7, 2, 3, 4]).block_hashes


def test_lookup_counts_whole_leading_blocks_only() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=100)
    index.learn(token_key(list(range(12))), "p0")
    assert index.lookup(token_key([*range(10), 99, 98])).tokens == 8  # diverges in block 3
    assert index.lookup(token_key([*range(3), 99, *range(4, 12)])) == NO_HIT


def test_a_whole_prompt_seen_before_is_an_exact_hit_and_a_longer_one_is_not() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=100)
    prompt = list(range(10))
    index.learn(token_key(prompt), "l1")
    same = index.lookup(token_key(prompt))
    assert (same.tokens, same.exact, same.holder) == (10, True, "l1")
    longer = index.lookup(token_key([*prompt, 10, 11]))
    assert (longer.tokens, longer.exact) == (8, False)  # blocks only: the linear state is not reusable


def test_the_holder_of_the_deepest_block_holds_the_whole_hit() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=100)
    index.learn(token_key(list(range(16))), "l0")
    index.learn(token_key([*range(8), 50, 51, 52, 53]), "l1")  # shares l0's first two blocks
    deep = index.lookup(token_key([*range(16), 1]))
    assert (deep.tokens, deep.holder) == (16, "l0")  # only l0 computed blocks 2 and 3
    shared = index.lookup(token_key([*range(8), 5]))
    assert (shared.tokens, shared.holder) == (8, "l1")  # l1 computed blocks 0 and 1 with its own


def test_every_hit_names_its_holder_and_no_hit_names_none() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=100)
    index.learn(token_key(list(range(10))), "l0")
    for ids in (list(range(10)), list(range(9)), [*range(4), 7, 7, 7, 7]):
        assert index.lookup(token_key(ids)).holder == "l0"
    assert index.lookup(token_key([9] * 10)) == NO_HIT and NO_HIT.holder is None


def test_an_offload_teaches_the_pd_cluster_nothing() -> None:
    """SGLang's decode receives the KV of an offloaded prompt, but no local prefill can start
    from it: only the PrfaaS prefill that computed it holds it."""
    indexes = ClusterIndexes(max_blocks=100, max_prompts=100)
    key = token_key(list(range(12)))
    indexes.learn_computed(ROUTE_PRFAAS, "p0", [key])
    local, prfaas = indexes.hits([token_key(list(range(12)))])
    assert local == NO_HIT
    assert (prfaas.tokens, prfaas.exact, prfaas.holder) == (12, True, "p0")
    indexes.learn_computed(ROUTE_LOCAL, "l1", [token_key([*range(12), 99])])
    local, prfaas = indexes.hits([token_key(list(range(12)))])
    assert (local.tokens, local.exact, local.holder) == (12, False, "l1")
    assert prfaas.holder == "p0" and len(indexes.prfaas) == 3


def test_a_pooled_cluster_learns_the_prompt_in_its_pool_and_the_other_cluster_does_not() -> None:
    """With a shared pool, what any prefill of a cluster computed is readable by each of them:
    the pool index holds it (its holder is the pool), the other cluster's pool nothing."""
    indexes = ClusterIndexes(max_blocks=100, max_prompts=100)
    indexes.learn_computed(ROUTE_LOCAL, "l0", [token_key(list(range(12)))], pooled=True)
    probe = [token_key([*range(12), 7])]
    pooled = indexes.pool_hit(ROUTE_LOCAL, probe)
    assert (pooled.tokens, pooled.exact, pooled.holder) == (12, False, POOL_HOLDER)
    assert indexes.pool_hit(ROUTE_PRFAAS, probe) == NO_HIT
    local, prfaas = indexes.hits(probe)
    assert local.holder == "l0" and prfaas == NO_HIT
    assert indexes.decode_hit(probe) == NO_HIT  # no decode named: the decodes keep nothing


def test_a_cluster_without_a_pool_learns_nothing_in_its_pool() -> None:
    indexes = ClusterIndexes(max_blocks=100, max_prompts=100)
    indexes.learn_computed(ROUTE_PRFAAS, "p0", [token_key(list(range(12)))])
    assert indexes.pool_hit(ROUTE_PRFAAS, [token_key(list(range(12)))]) == NO_HIT
    assert indexes.block_counts() == {"local": 0, "prfaas": 3, "pool_local": 0, "pool_prfaas": 0, "decode": 0}


def test_the_decode_that_served_a_prompt_holds_it_whichever_cluster_prefilled_it() -> None:
    """The decode radix cache keeps what the decode served, offloaded or not; a follow-up turn's
    hit there is the previous prompt's whole blocks."""
    indexes = ClusterIndexes(max_blocks=100, max_prompts=100)
    indexes.learn_computed(ROUTE_PRFAAS, "p0", [token_key(list(range(10)))], decode="d1")
    follow_up = [token_key([*range(10), 50, 51, 52, 53, 54])]
    held = indexes.decode_hit(follow_up)
    assert (held.tokens, held.holder) == (8, "d1")
    assert indexes.hits(follow_up)[0] == NO_HIT  # a local prefill still has nothing of it
    indexes.learn_computed(ROUTE_LOCAL, "l0", follow_up, decode="d0")
    assert indexes.decode_hit(follow_up).holder == "d0"


def test_memory_is_bounded_and_tails_are_evicted_before_their_prefixes() -> None:
    index = PrefixIndex(max_blocks=6, max_prompts=2)
    index.learn(token_key(list(range(16))), "a")  # 4 blocks
    index.learn(token_key(list(range(100, 116))), "b")  # 4 more: 2 of the first evicted
    assert len(index) == 6
    first = index.lookup(token_key(list(range(16))))
    assert (first.tokens, first.exact) == (8, False)  # its two leading blocks survive, not the tail
    assert index.lookup(token_key(list(range(100, 116)))).exact


def test_text_blocks_use_the_calibrated_characters_per_token() -> None:
    key = key_for_text("x" * 100, block_size_tokens=4, chars_per_token=2.5)
    assert len(key.block_hashes) == 10 and key.tokens == 40 and key.block_tokens == 4
    index = PrefixIndex(max_blocks=100, max_prompts=10)
    index.learn(key, "p0")
    assert index.lookup(key_for_text("x" * 95 + "y" * 20, 4, 2.5)).tokens == 36


def test_text_and_token_keys_never_share_blocks() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=10)
    index.learn(key_for_text("abcdabcd", 4, 1.0), "p0")
    assert index.lookup(token_key([97, 98, 99, 100, 97, 98, 99, 100], 4)) == NO_HIT


def test_a_prompt_under_one_salt_hits_nothing_learnt_under_another_or_none() -> None:
    ids = list(range(10))
    text = "w" * 40
    indexes = ClusterIndexes(max_blocks=100, max_prompts=10)
    salted = [key_for_tokens(token_buffer(ids), B, "tenant-a"), key_for_text(text, B, 4.0, "tenant-a")]
    indexes.learn_computed(ROUTE_PRFAAS, "p0", salted, pooled=True, decode="d0")
    for salt in ("tenant-b", None):
        others = [key_for_tokens(token_buffer(ids), B, salt), key_for_text(text, B, 4.0, salt)]
        for key in others:
            assert indexes.hits([key]) == (NO_HIT, NO_HIT)
            assert indexes.pool_hit(ROUTE_PRFAAS, [key]) == NO_HIT
            assert indexes.decode_hit([key]) == NO_HIT
    again = [key_for_tokens(token_buffer(ids), B, "tenant-a"), key_for_text(text, B, 4.0, "tenant-a")]
    for key in again:
        assert indexes.hits([key])[1].exact
        assert indexes.pool_hit(ROUTE_PRFAAS, [key]).exact
        assert indexes.decode_hit([key]).holder == "d0"


def test_an_unsalted_key_is_the_key_of_today() -> None:
    assert (
        key_for_tokens(token_buffer([1, 2, 3, 4, 5]), B, None).block_hashes
        == token_key([1, 2, 3, 4, 5]).block_hashes
    )
    assert key_for_text("abcdefgh", 2, 1.0, None).full_hash == key_for_text("abcdefgh", 2, 1.0).full_hash


def test_the_whole_prompt_hash_covers_the_tail_and_its_length() -> None:
    tails = [token_key(ids) for ids in ([1, 2, 3, 4], [1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 0], [1, 2, 3, 4, 1])]
    assert len({key.block_hashes for key in tails}) == 1 and len({key.full_hash for key in tails}) == 4
    texts = [key_for_text(text, 4, 1.0) for text in ("abcd", "abcd\0", "abcd\0\0", "abcde")]
    assert len({key.block_hashes for key in texts}) == 1 and len({key.full_hash for key in texts}) == 4


def test_text_blocks_hash_any_string_by_characters() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=10)
    prompt = "é" * 6 + "\U0001f600\ud800"  # beyond ASCII, and a lone surrogate (json lets those through)
    index.learn(key_for_text(prompt, 4, 1.0), "p0")
    assert index.lookup(key_for_text(prompt, 4, 1.0)).exact
    assert index.lookup(key_for_text("é" * 6 + "\U0001f600\ud801", 4, 1.0)).tokens == 4
    assert index.lookup(key_for_text("é" * 7 + "\ud800", 4, 1.0)).tokens == 4  # no emoji in block 2


def test_ids_past_2_to_the_63_hash_like_any_other() -> None:
    big = [2**64 - 1, 2**63, 2**63 + 1, 5]
    index = PrefixIndex(max_blocks=100, max_prompts=10)
    index.learn(token_key(big * 2), "p0")
    assert index.lookup(token_key(big * 2)).exact
    assert index.lookup(token_key([*big, 2**64 - 2, *big[1:]])).tokens == 4
    assert index.lookup(token_key([2**63 - 1, *big[1:]])) == NO_HIT


def test_token_buffers_hold_uint64_ids_only() -> None:
    assert token_buffer([0, 2**63, 2**64 - 1]).tolist() == [0, 2**63, 2**64 - 1]
    for not_ints in ([1, True], [1, 2.0], [1, [2]], [1, None], [1, "2"]):
        with pytest.raises(TypeError, match="integers"):
            token_buffer(not_ints)  # type: ignore[arg-type]
    for out_of_range in ([1, -1], [2**64]):
        with pytest.raises(ValueError, match=r"2\*\*64"):
            token_buffer(out_of_range)
    for not_a_buffer in ([1, 2, 3, 4], memoryview(b"12345678")):
        with pytest.raises(TypeError, match="token_buffer"):
            key_for_tokens(not_a_buffer, B)  # type: ignore[arg-type]


def test_lookup_all_adds_up_a_batch() -> None:
    index = PrefixIndex(max_blocks=100, max_prompts=10)
    index.learn(token_key(list(range(8))), "p0")
    keys = [token_key([*range(8), 1]), token_key(list(range(8))), token_key([7] * 9)]
    total = index.lookup_all(keys)
    assert (total.tokens, total.exact, total.holder) == (16, False, "p0")
    assert index.lookup_all([token_key(list(range(8)))] * 2).exact


def test_a_batch_counts_only_what_the_instance_holding_most_of_it_holds() -> None:
    """A batch is prefilled on one instance, which reuses its own cache alone."""
    index = PrefixIndex(max_blocks=100, max_prompts=10)
    index.learn(token_key(list(range(8))), "p0")
    index.learn(token_key(list(range(100, 112))), "p1")
    keys = [token_key(list(range(8))), token_key(list(range(100, 112)))]
    batch = index.lookup_all(keys)
    assert (batch.tokens, batch.exact, batch.holder) == (12, False, "p1")  # p1 holds 12, p0 8
    assert index.lookup_all([token_key([5] * 8), token_key([6] * 8)]) == NO_HIT


def test_capacities_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        PrefixIndex(max_blocks=0, max_prompts=1)


@given(
    a=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    b=st.lists(st.integers(0, 3), min_size=1, max_size=40),
)
def test_a_hit_is_the_common_prefix_rounded_down_to_blocks(a: list[int], b: list[int]) -> None:
    index = PrefixIndex(max_blocks=1000, max_prompts=1000)
    index.learn(token_key(a), "x")
    found = index.lookup(token_key(b))
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
        index.learn(token_key(prompt), "p0")
        assert len(index) <= 7
