"""Optional: the model's own tokenizer, so text prompts are counted and hashed in real tokens.

Without it a text prompt's tokens are estimated from its characters (`chars_per_token` of the
config) and its prefix blocks are blocks of characters. With `--tokenizer tokenizer.json` (a
Hugging Face `tokenizers` file, read from disk: nothing is downloaded; the operator mounts the
one `spec.router.tokenizer` names) the
threshold sees the exact count and the prefix index hashes token blocks, as for requests that
carry token ids. Chat messages are tokenized as their joined text, without the chat template,
whose few tokens per message the engine adds.

Tokenizing is not free (on the project's 2-core machine: ~1.4 ms for 2 KB of text, ~0.6 s for
560 KB), so it runs in worker threads (the library releases the GIL) and never blocks the event
loop; only requests with text prompts wait for it. The threads are the tokenizer's own
(`TOKENIZER_THREADS`), so it never holds up what else the router runs in threads (config reads,
engines' metrics pages), and a request whose texts hold more than `max_chars` characters is not
tokenized at all: its tokens are estimated from its characters, as without a tokenizer. Eight
prompts of 2M characters made small requests wait 12.7 s and left the router at 1.86 GB.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_THREADS = 2


class TokenizerError(Exception):
    """The tokenizer file cannot be used."""


class PromptTokenizer:
    def __init__(self, path: Path, max_chars: int) -> None:
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the library raises plain Exception for unreadable or invalid files
            raise TokenizerError(f"cannot load tokenizer {path}: {err}") from err
        self.path = path
        self.max_chars = max_chars
        self._threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")

    def token_buffers(self, texts: Sequence[str]) -> list[memoryview]:
        """Each text's token ids, as the uint64 buffers the prefix index hashes."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [memoryview(array("Q", encoding.ids)) for encoding in encodings]

    async def token_buffers_off_loop(self, texts: Sequence[str]) -> list[memoryview] | None:
        """`token_buffers` in the tokenizer's threads; None (estimate instead) past `max_chars`."""
        if sum(len(text) for text in texts) > self.max_chars:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.token_buffers, texts)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
