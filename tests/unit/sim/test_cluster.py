"""The simulated engines: prefill time with prefix hits and packing, decode step timing."""

import pytest
from prfaas_core.profiles import PrefillTimeModel
from prfaas_core.routing.prefix_index import PrefixIndex, PromptKey
from prfaas_sim.cluster import DecodeInstance, PrefillInstance, SimRequest

H20 = PrefillTimeModel.fit([(1024, 0.690), (8192, 1.571), (32768, 5.086), (131072, 26.814)])


def request(tokens: int, key: PromptKey | None = None, output: int = 100) -> SimRequest:
    return SimRequest(0.0, tokens, output, key, counted=True)


def key(blocks: tuple[int, ...], tokens: int) -> PromptKey:
    return PromptKey(blocks, hash((blocks, tokens)), tokens, 512)


def test_one_request_per_forward_takes_its_profiled_time_in_arrival_order():
    instance = PrefillInstance("p", H20, offloads=False, cache=None, batch_tokens=0)
    instance.queue.extend([request(8192), request(1024)])
    assert instance.start_batch(0.0) == pytest.approx(H20.seconds_for(8192))
    assert [r.total_tokens for r in instance.finish_batch()] == [8192]
    assert instance.start_batch(0.0) == pytest.approx(H20.seconds_for(1024))


def test_packing_pays_the_constant_term_once_and_stops_at_the_token_budget():
    instance = PrefillInstance("p", H20, offloads=False, cache=None, batch_tokens=16384)
    instance.queue.extend([request(4096), request(8192), request(8192)])
    expected = H20.seconds_for(4096) + H20.seconds_for(8192) - H20.c0
    assert instance.start_batch(0.0) == pytest.approx(expected)
    assert len(instance.finish_batch()) == 2 and len(instance.queue) == 1


def test_a_repeated_prompt_hits_the_cache_and_a_shared_prefix_saves_only_attention():
    cache = PrefixIndex(max_blocks=100, max_prompts=10)
    instance = PrefillInstance("p", H20, offloads=False, cache=cache, batch_tokens=0)
    first = key((1, 2, 3, 4), 2048)
    instance.queue.append(request(2048, first))
    assert instance.start_batch(0.0) == pytest.approx(H20.seconds_for(2048))
    instance.finish_batch()  # now cached
    instance.queue.append(request(2048, first))
    assert instance.start_batch(0.0) == pytest.approx(H20.c0)  # exact hit: nothing left to compute
    instance.finish_batch()
    instance.queue.append(request(3072, key((1, 2, 3, 4, 9, 10), 3072)))
    saved = H20.c2 * 2048**2  # the attention over the 2048 cached tokens; the linear work is redone
    assert instance.start_batch(0.0) == pytest.approx(H20.seconds_for(3072) - saved)


def test_a_decode_request_joins_at_the_next_step_and_holds_its_slot_for_every_output_token():
    decode = DecodeInstance("d", max_batch=2, step_seconds=0.025)
    late = request(1000, output=40)
    done = decode.join(late, now=0.01)
    assert late.first_token == pytest.approx(0.05)
    assert done == pytest.approx(0.025 + 40 * 0.025)
    assert decode.running == 1 and not decode.idle


def test_a_pool_serves_a_prefill_that_never_saw_the_prompt_and_charges_its_fetch():
    pool = PrefixIndex(max_blocks=100, max_prompts=10)
    fetch = 1e-5  # seconds per token of KV fetched from the pool
    a, b = (
        PrefillInstance(
            name,
            H20,
            offloads=False,
            cache=PrefixIndex(max_blocks=100, max_prompts=10),
            batch_tokens=0,
            pool=pool,
            fetch_seconds_per_token=fetch,
        )
        for name in ("a", "b")
    )
    a.queue.append(request(2048, key((1, 2, 3, 4), 2048)))
    a.start_batch(0.0)
    a.finish_batch()  # a computed it: its cache and the pool hold it
    b.queue.append(request(3072, key((1, 2, 3, 4, 9, 10), 3072)))
    saved = H20.c2 * 2048**2
    assert b.start_batch(0.0) == pytest.approx(H20.seconds_for(3072) - saved + 2048 * fetch)
    assert (b.tokens.prompt, b.tokens.reused, b.tokens.pool) == (3072, 2048, 2048)


def test_no_pool_fetch_when_fewer_than_256_tokens_are_left_to_compute():
    """SGLang's HiCache asks its storage only past `prefetch_threshold` (256) tokens its own tree lacks."""

    def small(blocks: tuple[int, ...], tokens: int) -> PromptKey:
        return PromptKey(blocks, hash((blocks, tokens)), tokens, 64)

    pool = PrefixIndex(max_blocks=100, max_prompts=10)
    pool.learn(small((1, 2, 3), 192), "(pool)")
    own = PrefixIndex(max_blocks=100, max_prompts=10)
    own.learn(small((1, 2), 128), "b")
    b = PrefillInstance("b", H20, offloads=False, cache=own, batch_tokens=0, pool=pool)
    b.queue.append(request(200, small((1, 2, 3), 200)))
    b.start_batch(0.0)
    assert (b.tokens.reused, b.tokens.pool) == (128, 0)  # 72 left after its own 128: no fetch
    c = PrefillInstance("c", H20, offloads=False, cache=None, batch_tokens=0, pool=pool)
    c.queue.append(request(500, small((1, 2, 3, 7, 8, 9, 10), 500)))
    c.start_batch(0.0)
    assert (c.tokens.reused, c.tokens.pool) == (192, 192)  # 500 left: the pool's 192 are fetched


def test_a_decode_with_its_radix_cache_holds_what_it_served_and_never_the_last_token():
    decode = DecodeInstance("d", max_batch=2, step_seconds=0.025, cache=PrefixIndex(100, 10))
    served = request(2048, key((1, 2, 3, 4), 2048))
    assert decode.held_tokens(served) == 0
    decode.keep(served)
    assert decode.held_tokens(request(3072, key((1, 2, 3, 4, 9, 10), 3072))) == 2048
    assert decode.held_tokens(request(2048, key((1, 2, 3, 4), 2048))) == 2047
    plain = DecodeInstance("e", max_batch=2, step_seconds=0.025)
    plain.keep(served)
    assert plain.held_tokens(served) == 0
