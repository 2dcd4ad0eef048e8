"""HiCache (`--enable-hierarchical-cache`) on a storage backend shared by two prefills, observed.

Two PD prefills (1 and 2) of one cluster with HiCache and the same storage, and one decode over
Mooncake (TCP). A long prompt X goes through prefill 1; once its pages are in the storage, X goes
through prefill 2 (which never saw it), then again through prefill 2 (now in its own radix tree),
then a fresh prompt Y of the same length through prefill 2 (nothing cached: the compute cost).
For each: `meta_info.cached_tokens` (and its device/host/storage split), the prefill's counters
(`sglang:cached_tokens_total{cache_source}`, `realtime_tokens_total{mode}`) and the time.

Backends: `file` (a directory both prefills use: `--hicache-storage-backend-extra-config
'{"file_storage_path": DIR}'`, srt/mem_cache/hicache_storage.py `HiCacheFile`) or `mooncake`
(Mooncake Store: a `mooncake_master` from the venv's mooncake wheel, P2P handshake,
srt/mem_cache/storage/mooncake_store/mooncake_store.py).

On CPU, HiCache as shipped stops at start-up (its host pool is pinned with cudaHostRegister);
the CPU workarounds the real engine's venv installs (prfaas_sglang_cpu.hicache, and
`--hicache-io-backend direct` in their engine arguments) get past that and the CUDA-only copies
(docs/sglang.md, "HiCache on a storage backend shared by two prefills").

  flock /tmp/real-engines.lock ~/.cache/prfaas/sglang-cpu/bin/python \
      testbed/sglang-cpu/experiments/hicache_shared_storage.py [--backend file|mooncake]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import _engines as E

P1, P2, D = "127.0.35.1", "127.0.35.2", "127.0.35.11"
PROMPT_TOKENS = 2000
HICACHE = [
    "--enable-hierarchical-cache",
    # (the io backend is the CPU workarounds' `direct`: layout page_first -> page_first_direct,
    # srt/arg_groups/hicache_hook.py)
    # wait for a storage prefetch to finish before scheduling the request (default: timeout)
    "--hicache-storage-prefetch-policy",
    "wait_complete",
]
MASTER_PORT, METRICS_PORT = 50134, 9134


@contextlib.contextmanager
def mooncake_master(logs: Path) -> Iterator[dict]:
    """Mooncake Store's master on loopback."""
    master = shutil.which("mooncake_master", path=str(E.VENV / "bin"))
    assert master, f"no mooncake_master in {E.VENV}/bin"
    log = (logs / "mooncake_master.log").open("wb")
    popen = subprocess.Popen(
        [
            master,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={MASTER_PORT}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={METRICS_PORT}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        time.sleep(3)
        assert popen.poll() is None, (logs / "mooncake_master.log").read_text()
        yield {
            "master_server_address": f"127.0.0.1:{MASTER_PORT}",
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "global_segment_size": 256 * 2**20,
            "local_buffer_size": 64 * 2**20,
        }
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        popen.wait(20)


def storage_files(directory: Path | None) -> tuple[int, int]:
    if directory is None:
        return 0, 0
    files = list(directory.glob("*.bin"))
    return len(files), sum(f.stat().st_size for f in files)


def send(name: str, prefill: E.Server, decode: E.Server, ids: list[int], store: Path | None) -> dict:
    before = E.metrics(prefill)
    p_answer, d_answer, seconds = E.pd_generate(prefill, decode, ids, new_tokens=2)
    E.settle([prefill])
    after = E.metrics(prefill)
    row = {
        "step": name,
        "prefill": prefill.name,
        "prompt_tokens": len(ids),
        "prefill_meta_cached": p_answer["meta_info"].get("cached_tokens"),
        "prefill_meta_details": p_answer["meta_info"].get("cached_tokens_details"),
        "decode_meta_cached": d_answer["meta_info"].get("cached_tokens"),
        "seconds": round(seconds, 3),
        "prefill_moved": E.delta(before, after),
        "storage_files_bytes": storage_files(store),
        "output_ids": d_answer["output_ids"],
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    E.main_guard()
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("file", "mooncake"), default="file")
    options = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix=f"hicache-{options.backend}-"))
    store = logs / "store" if options.backend == "file" else None
    with contextlib.ExitStack() as stack:
        if options.backend == "file":
            extra = {"file_storage_path": str(store)}
        else:
            extra = stack.enter_context(mooncake_master(logs))
        storage = [
            "--hicache-storage-backend",
            options.backend,
            "--hicache-storage-backend-extra-config",
            json.dumps(extra),
        ]
        specs = [
            ("prefill-1", P1, E.base_args(P1, "prefill") + HICACHE + storage),
            ("prefill-2", P2, E.base_args(P2, "prefill") + HICACHE + storage),
            ("decode", D, E.base_args(D, "decode")),
        ]
        for spec in specs:  # the engines' KV pools: 16384 tokens (8 MiB here), not 65536
            spec[2][spec[2].index("--max-total-tokens") + 1] = "16384"
        p1, p2, d = stack.enter_context(E.servers(specs, logs))
        x, y = E.tokens(3401, PROMPT_TOKENS), E.tokens(3402, PROMPT_TOKENS)
        rows = [send("X via prefill 1 (fresh)", p1, d, x, store)]
        time.sleep(10)  # write-through to the storage is asynchronous
        print("# storage after X: files, bytes", storage_files(store), flush=True)
        rows.append(send("X via prefill 2 (storage only)", p2, d, x, store))
        rows.append(send("X again via prefill 2 (its own tree)", p2, d, x, store))
        rows.append(send("Y via prefill 2 (fresh: compute cost)", p2, d, y, store))
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
