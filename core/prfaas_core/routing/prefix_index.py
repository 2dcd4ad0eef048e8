"""Which prompt prefixes each cluster holds: chained block hashes with LRU eviction (pure).

A prompt is cut into fixed-size blocks; each block's hash covers the block and the hash of
everything before it, so equal hashes mean equal prefixes (Mooncake's scheme). Blocks are token
blocks when the request carries token ids, otherwise text blocks of `block_size_tokens *
chars_per_token` characters, an estimate (the operator writes 4).

Hybrid models (paper 3.2): the full-attention KV is block-level and reusable on any block
prefix, but the linear-attention state is request-level and reusable only on an exact length
match. The index therefore also keeps a set of whole-prompt hashes; a hit is `exact` only when
the whole prompt was seen before. On a partial hit the linear state must be recomputed over the
prefix: `policy.prefill_seconds` charges that as the per-token (linear) work on the prefix, and
only the attention over the prefix (the quadratic term) counts as saved. `uncached_tokens`
(compared with the threshold and recorded for the planner) still counts the block prefix as
cached: the threshold is about attention-dominated work and the KV a prefill emits.

Each block is held by an instance: the prefill that computed it, whose radix cache is where that
engine reuses it; a cluster's shared pool and the decodes' radix caches have indexes of their own
(`ClusterIndexes`). A holder of a block computed every block before it too, so the holder of a
prompt's deepest held block holds the whole hit.

Blocks hash with xxh3-64, each seeded with the hash before it: token ids as uint64 bytes (the
request's decoded arrays, or `token_buffer`), text as UTF-8 per block of characters. That hashes
in C without a Python object per token, which keeps a 128K-token decision well under a
millisecond. xxh3 is not a keyed hash; that is fine here: the index is a routing hint that lives
and dies with one router (nothing persisted), and a collision, accidental or crafted, only
misroutes the requests that collide (the engines match cached tokens exactly). The seeds are drawn per process
all the same, which costs nothing and makes crafting one harder.

Tenancy: the engines keep one cache namespace per `cache_salt` (SGLang's radix cache and HiCache
storage key on it), so the same prompt under two salts shares nothing. A key made with a salt
starts its chain from a seed derived from the salt: the index then holds one namespace per salt
too, and a salt changed by a new config finds none of the old one's blocks, as on the engines.
"""

from __future__ import annotations

import math
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

from prfaas_core.vocabulary import ROUTE_PRFAAS

_TOKEN_SEED = secrets.randbits(64)
_TEXT_SEED = secrets.randbits(64)
_ID_BYTES = 8  # token ids are uint64


class PromptKey:
    """The hashes of one prompt sequence: one per full block (chained), and one for the whole.

    Hashed block by block as they are asked for: a lookup stops at the first block a cluster
    lacks, so a fresh 128K-token prompt costs one block before its route is chosen; learning it
    afterwards takes the rest. Built from given hashes (the simulator's traces) it holds just those.
    """

    __slots__ = (
        "_block_count",
        "_blocks",
        "_chain",
        "_full_hash",
        "_hashes",
        "_tail",
        "block_tokens",
        "tokens",
    )

    def __init__(self, block_hashes: Sequence[int], full_hash: int, tokens: int, block_tokens: int) -> None:
        self._hashes = list(block_hashes)
        self._block_count = len(self._hashes)
        self._blocks: Iterator[bytes | memoryview] = iter(())
        self._chain = 0
        self._tail: Callable[[], bytes] | None = None
        self._full_hash: int | None = full_hash
        self.tokens = tokens
        self.block_tokens = block_tokens

    @classmethod
    def chained(
        cls,
        seed: int,
        blocks: Iterator[bytes | memoryview],
        block_count: int,
        tail: Callable[[], bytes],
        tokens: int,
        block_tokens: int,
    ) -> PromptKey:
        """Hashes to compute: block i is xxh3(its bytes, seeded with block i-1's hash, block 0's
        with `seed`); the whole prompt's is xxh3(tail(), seeded with the last block's)."""
        key = cls((), 0, tokens, block_tokens)
        key._block_count = block_count
        key._blocks = blocks
        key._chain = seed
        key._tail = tail
        key._full_hash = None
        return key

    def hashes(self) -> Iterator[int]:
        """The block hashes in order, each computed on first use."""
        hashes = self._hashes
        for index in range(self._block_count):
            if index == len(hashes):
                self._chain = xxh3_64_intdigest(next(self._blocks), seed=self._chain)
                hashes.append(self._chain)
            yield hashes[index]

    @property
    def block_hashes(self) -> tuple[int, ...]:
        return tuple(self.all_hashes())

    @property
    def full_hash(self) -> int:
        if self._full_hash is None:
            self.all_hashes()
            assert self._tail is not None
            self._full_hash = xxh3_64_intdigest(self._tail(), seed=self._chain)
        return self._full_hash

    def all_hashes(self) -> Sequence[int]:
        """Every block hash, computing those not asked for yet (learning needs them all)."""
        if len(self._hashes) < self._block_count:
            for _ in self.hashes():
                pass
        return self._hashes


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """How much of a prompt one cluster holds, and the instance that holds it (None: no hit).

    Only `holder` can reuse it: each SGLang prefill has a radix cache of its own.
    """

    tokens: int
    exact: bool
    holder: str | None


NO_HIT = PrefixHit(tokens=0, exact=False, holder=None)


def token_buffer(ids: Sequence[int]) -> memoryview:
    """Token ids as `key_for_tokens` takes them: uint64s; TypeError or ValueError says what is wrong."""
    if not all(type(token) is int for token in ids):
        raise TypeError("token ids must be integers")
    try:
        return memoryview(array("Q", ids))
    except OverflowError as err:
        raise ValueError("token ids must be between 0 and 2**64 - 1") from err


def _salted(seed: int, salt: str | None) -> int:
    """The chain's first seed in `salt`'s namespace (None: the unsalted one)."""
    return seed if salt is None else xxh3_64_intdigest(salt.encode(errors="surrogatepass"), seed=seed)


def key_for_tokens(token_ids: memoryview, block_size_tokens: int, salt: str | None = None) -> PromptKey:
    """Key of a prompt given as uint64 token ids (`token_buffer`); blocks of `block_size_tokens` ids,
    in the cache namespace of `salt`."""
    if not isinstance(token_ids, memoryview) or token_ids.itemsize != _ID_BYTES:
        raise TypeError(
            f"token ids must be a memoryview of uint64s (see token_buffer), got {type(token_ids).__name__}"
        )
    data = token_ids.cast("B")
    length = len(token_ids)
    full_blocks = length // block_size_tokens
    block_bytes = block_size_tokens * _ID_BYTES
    end = full_blocks * block_bytes
    return PromptKey.chained(
        _salted(_TOKEN_SEED, salt),
        (data[start : start + block_bytes] for start in range(0, end, block_bytes)),
        full_blocks,
        lambda: bytes(data[end:]) + length.to_bytes(8, "little"),
        length,
        block_size_tokens,
    )


def key_for_text(
    text: str, block_size_tokens: int, chars_per_token: float, salt: str | None = None
) -> PromptKey:
    """Key of a prompt given as text, in the cache namespace of `salt`; tokens and block
    boundaries estimated from characters.

    Blocks are hashed as UTF-8; "surrogatepass" keeps the lone surrogates json lets through.
    """
    block_chars = max(1, round(block_size_tokens * chars_per_token))
    full_blocks = len(text) // block_chars
    end = full_blocks * block_chars
    return PromptKey.chained(
        _salted(_TEXT_SEED, salt),
        (
            text[start : start + block_chars].encode(errors="surrogatepass")
            for start in range(0, end, block_chars)
        ),
        full_blocks,
        lambda: text[end:].encode(errors="surrogatepass") + len(text).to_bytes(8, "little"),
        math.ceil(len(text) / chars_per_token),
        block_size_tokens,
    )


class PrefixIndex:
    """One cluster's cached prefixes: bounded LRU maps of block hash -> holder and of whole prompts."""

    def __init__(self, max_blocks: int, max_prompts: int) -> None:
        if max_blocks < 1 or max_prompts < 1:
            raise ValueError(f"prefix index capacities must be positive, got {max_blocks}, {max_prompts}")
        self._max_blocks = max_blocks
        self._max_prompts = max_prompts
        self._blocks: OrderedDict[int, str] = OrderedDict()  # value: the holding instance's name
        self._prompts: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, key: PromptKey) -> PrefixHit:
        """The longest leading run of held blocks; the whole prompt when it was seen before.

        The held blocks of a prompt always form a prefix of it (`learn` touches a prompt's blocks
        deepest first, so LRU eviction takes tails first): the whole prompt counts only when the
        walk reaches its end, and the walk stops at the first block missing. The holder is the
        deepest block's, which computed the blocks before it too.
        """
        blocks = self._blocks
        matched = 0
        holder = None
        for block_hash in key.hashes():
            found = blocks.get(block_hash)
            if found is None:
                break
            holder = found
            matched += 1
        else:
            exact_holder = self._prompts.get(key.full_hash)
            if exact_holder is not None:
                return PrefixHit(tokens=key.tokens, exact=True, holder=exact_holder)
        if holder is None:
            return NO_HIT
        return PrefixHit(tokens=min(matched * key.block_tokens, key.tokens), exact=False, holder=holder)

    def lookup_all(self, keys: Sequence[PromptKey]) -> PrefixHit:
        """A batch's hit at the one instance holding the most of it: a batch is prefilled on one
        instance, which reuses only what it holds. Exact only when it holds every prompt whole."""
        if len(keys) == 1:
            return self.lookup(keys[0])
        held: dict[str, list[PrefixHit]] = {}
        for hit in (self.lookup(key) for key in keys):
            if hit.holder is not None:
                held.setdefault(hit.holder, []).append(hit)
        if not held:
            return NO_HIT
        holder, hits = max(held.items(), key=lambda item: sum(hit.tokens for hit in item[1]))
        exact = len(hits) == len(keys) and all(hit.exact for hit in hits)
        return PrefixHit(sum(hit.tokens for hit in hits), exact, holder)

    def learn(self, key: PromptKey, holder: str) -> None:
        """Record that instance `holder` now has the prompt.

        The deepest block is touched first so that LRU eviction takes tails before the prefixes
        they extend, which keeps what remains a usable prefix.
        """
        blocks = self._blocks
        for block_hash in reversed(key.all_hashes()):
            blocks[block_hash] = holder
            blocks.move_to_end(block_hash)
        while len(blocks) > self._max_blocks:
            blocks.popitem(last=False)
        prompts = self._prompts
        full_hash = key.full_hash
        prompts[full_hash] = holder
        prompts.move_to_end(full_hash)
        while len(prompts) > self._max_prompts:
            prompts.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
        self._prompts.clear()


POOL_HOLDER = "(pool)"
"""The holder of a block in a cluster's pool index: the pool, which every prefill of the cluster reads."""


class ClusterIndexes:
    """The router's hybrid prefix index: what each cache that exists holds (the router's and the
    simulator's learning rule, `learn_computed`).

    - **A prefill instance's radix cache** (`local`, `prfaas`: one index per cluster, each block
      held by the instance that computed it): SGLang's prefill reuses its own tree only, so a
      prompt is learnt at the prefill that computed it, in the cluster of the route that ran.
    - **A cluster's shared pool** (`pool_local`, `pool_prfaas`; learnt only when that cluster has
      one, `pooled`): SGLang HiCache on a storage backend shared by the cluster's prefills. Every
      prefill writes what it computes there and a prefill that lacks a prefix fetches its pages
      (a storage hit), so the pool holds what any prefill of the cluster computed, readable by
      each of them (`POOL_HOLDER`). Another cluster's prefills never read it.
    - **The decode's radix cache** (`decode`; learnt only with
      `--disaggregation-decode-enable-radix-cache`): the decode that served a prompt keeps its
      KV, and when the next prompt extends it the prefill sends only the pages past what the
      decode holds (`decode_prefix_len`). It saves link bytes, never prefill compute: no prefill
      starts from the decode's tree. The index learns the prompt alone (the decode also keeps
      the answer, which the router does not hash), so a follow-up turn's hit is at most the
      previous prompt's whole blocks: an undercount, never a claim of bytes that do cross.

    The decode that received an offloaded prompt's KV gives a local prefill nothing (SGLang moves
    KV from prefill to decode only): no rule learns a prompt in the PD cluster's prefill caches
    because its KV reached a decode there.
    """

    __slots__ = ("decode", "local", "pool_local", "pool_prfaas", "prfaas")

    def __init__(self, max_blocks: int, max_prompts: int) -> None:
        self.local = PrefixIndex(max_blocks, max_prompts)
        self.prfaas = PrefixIndex(max_blocks, max_prompts)
        self.pool_local = PrefixIndex(max_blocks, max_prompts)
        self.pool_prfaas = PrefixIndex(max_blocks, max_prompts)
        self.decode = PrefixIndex(max_blocks, max_prompts)

    def hits(self, keys: Sequence[PromptKey]) -> tuple[PrefixHit, PrefixHit]:
        """What the PD cluster's and the PrfaaS cluster's prefill instances hold of a request."""
        return self.local.lookup_all(keys), self.prfaas.lookup_all(keys)

    def pool(self, route: str) -> PrefixIndex:
        """The pool index of `route`'s cluster."""
        return self.pool_prfaas if route == ROUTE_PRFAAS else self.pool_local

    def pool_hit(self, route: str, keys: Sequence[PromptKey]) -> PrefixHit:
        """What `route`'s cluster's pool holds of a request (meaningful only where one is deployed)."""
        return self.pool(route).lookup_all(keys)

    def decode_hit(self, keys: Sequence[PromptKey]) -> PrefixHit:
        """What the decode holding the most of a request holds (its `holder`), with the decode radix cache."""
        return self.decode.lookup_all(keys)

    def learn_computed(
        self,
        route: str,
        prefill: str,
        keys: Iterable[PromptKey],
        *,
        pooled: bool = False,
        decode: str | None = None,
    ) -> None:
        """`prefill`, of `route`'s cluster, computed these prompts and `decode` received their KV.

        Its radix cache holds them; so does its cluster's pool when `pooled` (the cluster has one),
        and the decode's radix cache when `decode` is named (the decodes keep what they served).
        """
        index = self.prfaas if route == ROUTE_PRFAAS else self.local
        pool = self.pool(route) if pooled else None
        decoded = self.decode if decode is not None else None
        for key in keys:
            index.learn(key, prefill)
            if pool is not None:
                pool.learn(key, POOL_HOLDER)
            if decoded is not None:
                assert decode is not None
                decoded.learn(key, decode)

    def block_counts(self) -> dict[str, int]:
        """Blocks held per index, for the router's /config page."""
        return {
            "local": len(self.local),
            "prfaas": len(self.prfaas),
            "pool_local": len(self.pool_local),
            "pool_prfaas": len(self.pool_prfaas),
            "decode": len(self.decode),
        }
