"""Mooncake Store on CPU, without SGLang: does the venv's `mooncake_master` serve two clients
over TCP on loopback, and what does a put and a get cost?

A master (no metadata server: the clients' transfer engines handshake peer to peer) and two store clients in two processes (two
"instances" of a cluster, each contributing a segment): client 1 puts N objects of one KV page
(16 tokens x 512 B = 8 KiB: tiny GPT-2) and of 1 MiB, client 2 reads them back. The client is
`mooncake.store.MooncakeDistributedStore`, what SGLang's mooncake HiCache backend uses
(srt/mem_cache/storage/mooncake_store/mooncake_store.py `MooncakeStore.__init__`: `setup(...)`).

  ~/.cache/prfaas/sglang-cpu/bin/python testbed/sglang-cpu/experiments/mooncake_store_smoke.py
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

VENV = Path(os.environ.get("PRFAAS_SGLANG_CPU_VENV") or Path.home() / ".cache" / "prfaas" / "sglang-cpu")
MASTER, METRICS = 50135, 9135
HOSTS = ("127.0.36.1", "127.0.36.2")
SIZES = {"page_8KiB": 16 * 512, "1MiB": 2**20}
COUNT = 200


def client(host: str, role: str, queue: multiprocessing.Queue) -> None:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        host,
        "P2PHANDSHAKE",  # no metadata server: each client's transfer engine listens on `host`
        512 * 2**20,  # the segment this client contributes to the pool
        128 * 2**20,  # its local transfer buffer
        "tcp",
        "",
        f"127.0.0.1:{MASTER}",
    )
    result: dict = {"host": host, "role": role, "setup_rc": rc}
    if rc == 0:
        for name, size in SIZES.items():
            payload = os.urandom(size)
            t0 = time.perf_counter()
            if role == "writer":
                codes = [store.put(f"{name}-{i}", payload) for i in range(COUNT)]
                result[f"put_{name}_ms_each"] = round((time.perf_counter() - t0) * 1000 / COUNT, 3)
                result[f"put_{name}_failures"] = sum(1 for c in codes if c != 0)
            else:
                values = [store.get(f"{name}-{i}") for i in range(COUNT)]
                result[f"get_{name}_ms_each"] = round((time.perf_counter() - t0) * 1000 / COUNT, 3)
                result[f"get_{name}_found"] = sum(1 for v in values if len(v) == size)
        if role == "writer":
            queue.put(result)
            time.sleep(60)  # keep this client's segment (it holds the objects) until the reader is done
            return
    queue.put(result)


def main() -> None:
    logs = Path(tempfile.mkdtemp(prefix="mooncake-store-"))
    log = (logs / "mooncake_master.log").open("wb")
    master = subprocess.Popen(
        [
            str(VENV / "bin" / "mooncake_master"),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={MASTER}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={METRICS}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    writer = None
    try:
        time.sleep(3)
        assert master.poll() is None, (logs / "mooncake_master.log").read_text()
        queue: multiprocessing.Queue = multiprocessing.Queue()
        env = {"MC_FORCE_TCP": "1"}
        os.environ.update(env)
        writer = multiprocessing.Process(target=client, args=(HOSTS[0], "writer", queue))
        writer.start()
        print(json.dumps(queue.get(timeout=120)), flush=True)
        reader = multiprocessing.Process(target=client, args=(HOSTS[1], "reader", queue))
        reader.start()
        print(json.dumps(queue.get(timeout=120)), flush=True)
        reader.join(30)
    finally:
        if writer is not None and writer.is_alive():
            writer.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(master.pid, signal.SIGTERM)
        master.wait(20)
        print(f"# master log: {logs / 'mooncake_master.log'}")


if __name__ == "__main__":
    main()
