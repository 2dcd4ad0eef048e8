"""Which prompt prefixes each cluster holds: chained block hashes with LRU eviction (pure).

A prompt is cut into fixed-size blocks; each block's hash covers the block and the hash of
everything before it, so equal hashes mean equal prefixes (Mooncake's scheme). Blocks are token
blocks when the request carries token ids, otherwise text blocks of `block_size_tokens *
chars_per_token` characters, an estimate calibrated by the operator.

Hybrid models (paper 3.2): the full-attention KV is block-level and reusable on any block
prefix, but the linear-attention state is request-level and reusable only on an exact length
match. The index therefore also keeps a set of whole-prompt hashes; a hit is `exact` only when
the whole prompt was seen before. On a partial hit the linear state must be recomputed over the
prefix: `policy.prefill_seconds` charges that as the per-token (linear) work on the prefix, and
only the attention over the prefix (the quadratic term) counts as saved. `uncached_tokens`
(compared with the threshold and recorded for the planner) still counts the block prefix as
cached: the threshold is about attention-dominated work and the KV a prefill emits.

Hashes use Python's `hash`, salted per process: the index lives and dies with one router.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_TOKEN_SEED = hash(("prfaas-token-blocks",))
_TEXT_SEED = hash(("prfaas-text-blocks",))


@dataclass(frozen=True, slots=True)
class PromptKey:
    """The hashes of one prompt sequence: one per full block (chained), and one for the whole."""

    block_hashes: tuple[int, ...]
    full_hash: int
    tokens: int
    block_tokens: int


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """How much of a prompt one cluster holds, and the instance known to hold the deepest part of it."""

    tokens: int
    exact: bool
    holder: str | None


NO_HIT = PrefixHit(tokens=0, exact=False, holder=None)


def key_for_tokens(token_ids: Sequence[int], block_size_tokens: int) -> PromptKey:
    """Key of a prompt given as token ids; blocks of `block_size_tokens` tokens."""
    ids = tuple(token_ids)
    full_blocks = len(ids) // block_size_tokens
    chain = _TOKEN_SEED
    hashes = []
    for start in range(0, full_blocks * block_size_tokens, block_size_tokens):
        chain = hash((chain, ids[start : start + block_size_tokens]))
        hashes.append(chain)
    full = hash((chain, ids[full_blocks * block_size_tokens :], len(ids)))
    return PromptKey(tuple(hashes), full, len(ids), block_size_tokens)


def key_for_text(text: str, block_size_tokens: int, chars_per_token: float) -> PromptKey:
    """Key of a prompt given as text; tokens and block boundaries estimated from characters."""
    block_chars = max(1, round(block_size_tokens * chars_per_token))
    full_blocks = len(text) // block_chars
    chain = _TEXT_SEED
    hashes = []
    for start in range(0, full_blocks * block_chars, block_chars):
        chain = hash((chain, text[start : start + block_chars]))
        hashes.append(chain)
    full = hash((chain, text[full_blocks * block_chars :], len(text)))
    tokens = math.ceil(len(text) / chars_per_token)
    return PromptKey(tuple(hashes), full, tokens, block_size_tokens)


class PrefixIndex:
    """One cluster's cached prefixes: bounded LRU maps of block hash -> holder and of whole prompts."""

    def __init__(self, max_blocks: int, max_prompts: int) -> None:
        if max_blocks < 1 or max_prompts < 1:
            raise ValueError(f"prefix index capacities must be positive, got {max_blocks}, {max_prompts}")
        self._max_blocks = max_blocks
        self._max_prompts = max_prompts
        # value: the holding instance's name, "" when only the cluster as a whole is known to hold it
        self._blocks: OrderedDict[int, str] = OrderedDict()
        self._prompts: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, key: PromptKey) -> PrefixHit:
        """The longest leading run of held blocks; the whole prompt when it was seen before."""
        blocks = self._blocks
        exact_holder = self._prompts.get(key.full_hash)
        # a whole prompt counts only while its blocks do (tails are evicted first: check the last)
        if exact_holder is not None and (not key.block_hashes or key.block_hashes[-1] in blocks):
            return PrefixHit(tokens=key.tokens, exact=True, holder=exact_holder or None)
        matched = 0
        holder = ""
        for block_hash in key.block_hashes:
            found = blocks.get(block_hash)
            if found is None:
                break
            holder = found or holder
            matched += 1
        if matched == 0:
            return NO_HIT
        return PrefixHit(
            tokens=min(matched * key.block_tokens, key.tokens), exact=False, holder=holder or None
        )

    def lookup_all(self, keys: Sequence[PromptKey]) -> PrefixHit:
        """The hits of a batch's prompts added up; exact only when every prompt is."""
        if len(keys) == 1:
            return self.lookup(keys[0])
        hits = [self.lookup(key) for key in keys]
        holder = next((hit.holder for hit in hits if hit.holder is not None), None)
        return PrefixHit(sum(hit.tokens for hit in hits), all(hit.exact for hit in hits), holder)

    def learn(self, key: PromptKey, holder: str | None) -> None:
        """Record that `holder` (an instance name, or None for 'somewhere in the cluster') now has it.

        None keeps a block's known holder. The deepest block is touched first so that LRU eviction
        takes tails before the prefixes they extend, which keeps what remains a usable prefix.
        """
        blocks = self._blocks
        if holder is None:
            for block_hash in reversed(key.block_hashes):
                blocks.setdefault(block_hash, "")
                blocks.move_to_end(block_hash)
        else:
            for block_hash in reversed(key.block_hashes):
                blocks[block_hash] = holder
                blocks.move_to_end(block_hash)
        while len(blocks) > self._max_blocks:
            blocks.popitem(last=False)
        prompts = self._prompts
        if holder is None:
            prompts.setdefault(key.full_hash, "")
        else:
            prompts[key.full_hash] = holder
        prompts.move_to_end(key.full_hash)
        while len(prompts) > self._max_prompts:
            prompts.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
        self._prompts.clear()
