"""The decode's radix cache in PD (`--disaggregation-decode-enable-radix-cache`), observed.

A conversation of three turns, each turn's prompt = the previous prompt + its answer + new
tokens, through two prefills (A, the PrfaaS one; B, a local one) and one decode over Mooncake
(TCP), once with the decode radix cache on and once (the decode restarted) with it off:
  turn 1 via A (nothing cached anywhere), turn 2 via A (A and the decode hold turn 1),
  turn 3 via B (B holds nothing, the decode holds turn 2).
For each turn: the prompt's length, `meta_info.cached_tokens` of both legs, what each engine's
counters moved by (`sglang:cached_tokens_total{cache_source}`, `realtime_tokens_total{mode}`:
what the prefill computed, `kv_transfer_total_mb`: what crossed), and the KV a whole prompt
would be (whole pages x 16 x 512 B).

  flock /tmp/real-engines.lock ~/.cache/prfaas/sglang-cpu/bin/python \
      testbed/sglang-cpu/experiments/decode_radix_cache.py [--only on|off]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import _engines as E

A, B, D = "127.0.34.1", "127.0.34.2", "127.0.34.11"
RADIX = ["--disaggregation-decode-enable-radix-cache"]


def conversation(a: E.Server, b: E.Server, d: E.Server, seed: int) -> list[dict]:
    rows = []
    prompt: list[int] = E.tokens(seed, 300)
    answer: list[int] = []
    for turn, prefill in ((1, a), (2, a), (3, b)):
        if turn > 1:
            prompt = prompt + answer + E.tokens(seed + turn, 100)
        before = {s.name: E.metrics(s) for s in (a, b, d)}
        p_answer, d_answer, seconds = E.pd_generate(prefill, d, prompt)
        E.settle([a, b, d])
        after = {s.name: E.metrics(s) for s in (a, b, d)}
        answer = d_answer["output_ids"]
        rows.append(
            {
                "turn": turn,
                "prefill": prefill.name,
                "prompt_tokens": len(prompt),
                "whole_prompt_kv_mb": round(
                    math.ceil(len(prompt) / E.PAGE) * E.PAGE * E.KV_BYTES_PER_TOKEN / 2**20, 4
                ),
                "prefill_meta_cached": p_answer["meta_info"].get("cached_tokens"),
                "decode_meta_cached": d_answer["meta_info"].get("cached_tokens"),
                "decode_meta_cached_details": d_answer["meta_info"].get("cached_tokens_details"),
                "seconds": round(seconds, 2),
                "moved": {name: E.delta(before[name], after[name]) for name in before},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    E.main_guard()
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=("on", "off"))
    options = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="decode-radix-"))
    results = {}
    prefills = [("A", A, E.base_args(A, "prefill")), ("B", B, E.base_args(B, "prefill"))]
    with E.servers(prefills, logs) as (a, b):
        for seed, mode in ((1000, "on"), (2000, "off")):
            if options.only and mode != options.only:
                continue
            decode_args = E.base_args(D, "decode") + (RADIX if mode == "on" else [])
            with E.servers([(f"decode-radix-{mode}", D, decode_args)], logs / mode) as (d,):
                print(f"# decode radix cache {mode}", flush=True)
                results[mode] = conversation(a, b, d, seed)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
