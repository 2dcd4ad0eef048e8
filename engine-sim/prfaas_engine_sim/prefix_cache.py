"""The fake engine's prefix cache: chained hashes of fixed-size blocks, LRU, bounded.

SGLang's radix cache lets a prompt skip the KV it shares with an earlier one. The fake engine
keeps the part that changes timing: how many leading tokens are already cached on this
instance. Blocks are ``block_tokens`` token ids, or ``block_tokens * chars_per_token``
characters of text when a request carries no ids (the same calibrated estimate as the token
count). Each block's key chains its prefix, so a hit on block k implies blocks 0..k-1 matched.
Keys are Python hashes: meaningful only inside one engine process, which is all a per-instance
cache needs. A request's ``cache_salt`` starts its chain, so prompts under two salts (or one
salt and none) share no block, as SGLang's radix cache keys every child on it (radix_cache.py
``RadixKey.child_key_at``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def _chain_start(salt: str | None) -> int:
    return 0 if salt is None else hash(("cache_salt", salt))


def block_keys_for_ids(token_ids: Sequence[int], block_tokens: int, salt: str | None = None) -> list[int]:
    """Chained keys of every full block of token ids, in `salt`'s namespace."""
    keys: list[int] = []
    key = _chain_start(salt)
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        key = hash((key, tuple(token_ids[start : start + block_tokens])))
        keys.append(key)
    return keys


def block_keys_for_text(text: str, block_chars: int, salt: str | None = None) -> list[int]:
    """Chained keys of every full block of characters, in `salt`'s namespace."""
    keys: list[int] = []
    key = _chain_start(salt)
    for start in range(0, len(text) - block_chars + 1, block_chars):
        key = hash((key, text[start : start + block_chars]))
        keys.append(key)
    return keys


class PrefixCache:
    """Block keys present on this instance, least recently used evicted first."""

    def __init__(self, block_tokens: int, max_tokens: int) -> None:
        if block_tokens < 1 or max_tokens < block_tokens:
            raise ValueError(
                f"prefix cache needs block_tokens >= 1 and max_tokens >= block_tokens, got {block_tokens}, {max_tokens}"
            )
        self.block_tokens = block_tokens
        self.max_blocks = max_tokens // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    def match(self, keys: Sequence[int]) -> int:
        """Number of leading blocks present; each hit becomes most recently used."""
        matched = 0
        for key in keys:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            matched += 1
        return matched

    def insert(self, keys: Sequence[int]) -> None:
        """Remember a computed prompt's blocks, evicting the least recently used beyond the bound."""
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
