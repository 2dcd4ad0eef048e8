"""One engine instance across nodes (SGLang's ``--nnodes``, ``--node-rank``, ``--dist-init-addr``).

What SGLang 0.5.23 does, and the fake keeps:

- The schedulers of every node join one distributed group whose store node rank 0 hosts at
  ``--dist-init-addr``; loading the model waits until all ``--nnodes`` nodes have joined
  (``model_runner`` ``init_distributed_environment``, ``tcp://`` + the address).
- Only node rank 0 runs the tokenizer, the HTTP API and, on a prefill, the bootstrap server.
  Node ranks >= 1 wait for their schedulers to be ready, then serve a dummy health server on
  ``--host:--port`` whose ``/ping``, ``/health`` and ``/health_generate`` answer 200 at once
  (``entrypoints/engine.py`` ``_launch_subprocesses``, ``utils/common.py``
  ``launch_dummy_health_check_server``), ignore SIGTERM (rank 0's ShutdownReq broadcast stops
  their schedulers) and end when their schedulers do.
- Rank 0 broadcasts what it receives to every rank at each scheduler step, busy or idle, so a
  node that goes away fails the others' next broadcast: the whole group ends, and
  LeaderWorkerSet (``RecreateGroupOnPodRestart``) recreates it.

The fake's group: rank 0 listens on the ``--dist-init-addr`` port; every other rank connects
(retrying until rank 0 listens), sends ``join RANK NNODES`` and keeps the connection. Once all
ranks have joined, rank 0 answers each ``ready``. A connection that closes without rank 0's
``shutdown`` is a lost node: the engine at either end stops with exit status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

log = logging.getLogger("prfaas_engine_sim")

JOIN_RETRY_SECONDS = 1.0
JOIN_READ_SECONDS = 10.0
_READY, _SHUTDOWN = b"ready\n", b"shutdown\n"
DUMMY_HEALTH_PATHS = ("/ping", "/health", "/health_generate")


class Leader:
    """Node rank 0's side: waits for the other ranks, then watches them."""

    def __init__(self, nnodes: int, host: str, port: int) -> None:
        self.nnodes = nnodes
        self._host, self._port = host, port
        self._members: dict[int, asyncio.StreamWriter] = {}
        self._complete = asyncio.Event()
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        """Set to the reason once a joined rank goes away."""
        self._server: asyncio.Server | None = None
        self._closing = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._member, self._host, self._port, reuse_address=True)
        log.info("node rank 0 of %d: waiting for the other ranks on port %d", self.nnodes, self._port)

    async def wait_complete(self) -> None:
        await self._complete.wait()

    async def close(self) -> None:
        """Rank 0 stops: every rank is told to end (SGLang's ShutdownReq broadcast), unless the
        group is already lost (then rank 0's schedulers crashed: the others see it vanish)."""
        self._closing = True
        for writer in self._members.values():
            if not self.lost.done():
                with contextlib.suppress(ConnectionError):
                    writer.write(_SHUTDOWN)
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _member(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), JOIN_READ_SECONDS)
        except (TimeoutError, ConnectionError):
            writer.close()
            return
        words = line.decode(errors="replace").split()
        problem = self._refusal(words)
        if problem is not None:
            log.warning("node rank 0: refusing a peer: %s", problem)
            writer.write(f"refused {problem}\n".encode())
            writer.close()
            return
        rank = int(words[1])
        self._members[rank] = writer
        log.info("node rank 0: rank %d joined (%d of %d)", rank, len(self._members) + 1, self.nnodes)
        if len(self._members) == self.nnodes - 1:
            for member in self._members.values():
                member.write(_READY)
            self._complete.set()
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):  # nothing more is said: the end of the stream is the news
                pass
        if self._members.get(rank) is writer:
            del self._members[rank]
        if self._closing or self.lost.done():
            return
        if self._complete.is_set():
            self.lost.set_result(f"node rank {rank} of {self.nnodes} went away")
        else:
            log.warning("node rank 0: rank %d left before the group was complete", rank)

    def _refusal(self, words: list[str]) -> str | None:
        if len(words) != 3 or words[0] != "join" or not words[1].isdigit() or not words[2].isdigit():
            return f"not a join: {' '.join(words)[:80]!r}"
        rank, nnodes = int(words[1]), int(words[2])
        if nnodes != self.nnodes:
            return f"rank {rank} says --nnodes {nnodes}, rank 0 has {self.nnodes}"
        if not 1 <= rank < self.nnodes:
            return f"node rank {rank} is out of range for --nnodes {self.nnodes}"
        if rank in self._members or self._complete.is_set():
            return f"node rank {rank} has joined already"
        return None


async def join(
    host: str, port: int, rank: int, nnodes: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A rank >= 1 joins rank 0 (waiting for it to listen) and returns once the group is complete,
    with the connection to hold (a writer let go of closes it)."""
    logged = False
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as err:
            if not logged:
                log.info("node rank %d: waiting for rank 0 at %s:%d (%s)", rank, host, port, err)
                logged = True
            await asyncio.sleep(JOIN_RETRY_SECONDS)
            continue
        writer.write(f"join {rank} {nnodes}\n".encode())
        answer = await reader.readline()
        if answer == _READY:
            log.info("node rank %d of %d: the group is complete", rank, nnodes)
            return reader, writer
        writer.close()
        if answer.startswith(b"refused"):
            raise ValueError(f"rank 0 at {host}:{port} {answer.decode(errors='replace').strip()}")
        await asyncio.sleep(JOIN_RETRY_SECONDS)  # rank 0 went away meanwhile: wait for the next one


async def leader_gone(reader: asyncio.StreamReader) -> bool:
    """Waits for rank 0 to end the group; True when it said so (a shutdown), False when it vanished."""
    with contextlib.suppress(ConnectionError):
        return await reader.readline() == _SHUTDOWN
    return False


def dummy_health_app() -> web.Application:
    """What a rank >= 1 serves on the engine's port: 200 on SGLang's health paths, an empty
    ``/metrics`` (SGLang adds its Prometheus middleware with ``--enable-metrics``; its ranks >= 1
    write samples only with ``--enable-metrics-for-all-schedulers``), 404 elsewhere."""

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(status=200, content_type="text/plain")

    app = web.Application()
    for path in DUMMY_HEALTH_PATHS:
        app.router.add_get(path, healthy)
    app.router.add_get("/metrics", metrics)
    return app


async def follow(
    *, rank: int, nnodes: int, leader: tuple[str, int], host: str, port: int, model_load_seconds: float
) -> int:
    """A node rank >= 1 from start to end: join, load, serve the dummy health server until rank 0
    ends the group. Returns the exit status: 0 when rank 0 ended it, 1 when rank 0 vanished."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(
            signal.SIGTERM,
            lambda: log.warning(
                "SIGTERM received on node_rank %d; waiting for rank 0 to end the group", rank
            ),
        )
    reader, writer = await join(*leader, rank, nnodes)
    watching = asyncio.ensure_future(leader_gone(reader))
    if model_load_seconds:
        log.info("node rank %d: loading the model for %g s", rank, model_load_seconds)
        await asyncio.wait({watching}, timeout=model_load_seconds)
    if not watching.done():
        runner = web.AppRunner(dummy_health_app(), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
            log.info("node rank %d of %d: dummy health server on %s:%d", rank, nnodes, host, port)
            await asyncio.wait({watching})
        finally:
            await runner.cleanup()
    writer.close()
    if watching.result():
        log.info("node rank %d: rank 0 ended the group", rank)
        return 0
    log.error("node rank %d: lost rank 0 at %s:%d; the group is over", rank, *leader)
    return 1
