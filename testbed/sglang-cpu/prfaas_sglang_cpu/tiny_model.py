"""A tiny GPT-2-architecture model built here, for real SGLang on CPU (no hub download).

GPT-2 because SGLang's rotary layers import vLLM's custom ops on CPU
(`srt/layers/rotary_embedding/base.py`); GPT-2 has learned positions. The weights are real
random ones (std 0.2): `--load-format dummy` gives weights near +-1e-3, whose greedy decoding
is one constant token and so proves nothing about the KV that crossed. The tokenizer is a
byte-level BPE trained here on a fixed text, so prompts tokenize the same on every machine;
the router reads the same `tokenizer.json`.

Usage: python -m prfaas_sglang_cpu.tiny_model OUT_DIR   (idempotent: a complete OUT_DIR is kept)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel

EOS = "<|endoftext|>"
SEED = 20261201
CONFIG = {
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "n_positions": 8192,
    "vocab_size": 512,
}
"""KV per token as SGLang serves it: 2 layers x (K + V) x 64 x 2 bytes = 512 bytes (float16: its
"auto" dtype for a float32 checkpoint)."""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DONE = "prfaas-tiny-model.json"


def _training_text() -> list[str]:
    rng = random.Random(SEED)
    words = ["hello", "world", "prefill", "decode", "cache", "token", "cluster", "link", "kv", "route"]
    lines = [" ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(40)) for _ in range(400)]
    return lines + [f"w{i:05d}" for i in range(0, 100000, 7)]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer)
    return tokenizer


def build(out: Path) -> None:
    if (out / DONE).exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(CONFIG["vocab_size"])
    tokenizer.save(str(out / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "bos_token": EOS,
                "model_max_length": CONFIG["n_positions"],
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    torch.manual_seed(SEED)
    config = GPT2Config(**CONFIG, bos_token_id=eos_id, eos_token_id=eos_id, torch_dtype="float32")
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".weight") and parameter.dim() >= 2:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "do_sample": False}))
    (out / DONE).write_text(json.dumps({"seed": SEED, **CONFIG}))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
