"""A fake SGLang engine: SGLang 0.5's HTTP API, PD bootstrap and ``sglang:*`` metrics, timed by a profile.

The testbed runs one per engine pod, started from the pod's own SGLang arguments
(``--disaggregation-mode prefill --disaggregation-bootstrap-port 8998 ...``; unknown
arguments are ignored with a warning), so the router and the operator meet the protocol and
the numbers of a real deployment without GPUs::

    python -m prfaas_engine_sim --mode prefill --port 30000 --bootstrap-port 8998 --profile h200

What is emulated, and how:

* Prefill: one batch at a time from a FIFO queue (up to ``--max-prefill-tokens`` uncached
  tokens per batch), taking ``c0 + sum(T(l_i) - c0)`` seconds of the profile's fitted
  T_prefill on the uncached tokens, times ``--time-scale`` (0: no sleeping at all). A
  per-instance prefix cache (LRU, ``--prefix-cache-block-tokens``) supplies the cached part.
* Decode: at most ``--max-decode-batch`` running requests; the first token comes with the KV
  (as in SGLang, the prefill computes it), then one token per ``--decode-step-seconds``
  (scaled); the rest wait in the queue.
* PD (see kv_transfer): both legs carry the same body with ``bootstrap_host/port/room``; a
  PD engine refuses a request without them (400). The prefill waits for its decode to connect,
  computes in chunks of ``--chunked-prefill-size`` tokens, sends each chunk's share of
  round(S_kv(l) * ``--kv-scale``) real bytes once the chunk is computed (the fixed part, the
  state, with the last), and answers once they are delivered (one token, like SGLang's
  prefill). The decode generates once every byte has arrived. ``bootstrap_host`` 2.2.2.2
  (SGLang's health-check host) skips the transfer. Timeouts and the decode's heartbeat are
  SGLang's (300 s, 300 s, every 5 s, 2 misses) times ``--time-scale``, never below 5 s and 1 s.
* n > 1: each prompt's warm-up (max_new_tokens 0), then n copies, all on the prompt's room
  (SGLang's copies of one room collide; the fake refuses a room still in flight: kv_transfer).
* Metrics: per TP rank where SGLang's schedulers report them (see metrics).
* Tokens: input_ids count as given; text as ceil(characters / ``--chars-per-token``); a chat
  prompt is the concatenated text of its messages' content. Output: max_new_tokens /
  max_tokens (default ``--default-max-new-tokens``) words of four characters.
* Client disconnect or ``/abort_request`` aborts the request and frees its queue or batch slot.
* ``/metrics`` is always served (``--enable-metrics`` is accepted and changes nothing).
* One instance on several nodes (``--nnodes``, ``--node-rank``, ``--dist-init-addr``, as
  LeaderWorkerSet's env fills them): rank 0 is the engine above, once every rank has joined it;
  the others serve SGLang's dummy health server; a rank that goes away ends the group (group).

The pieces: settings (settings and the CLI), server (the HTTP API), pipeline (one item's way
through the engine), scheduler (the prefill and decode batchers), pd (the PD legs), timing
(profiles and timing), kv_transfer, prefix_cache, protocol, metrics and group (multi-node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from prfaas_engine_sim import group
from prfaas_engine_sim.server import FakeEngine
from prfaas_engine_sim.settings import EngineSettings, parse_address, parse_args

T = TypeVar("T")

log = logging.getLogger("prfaas_engine_sim")


async def serve(engine: FakeEngine, stop: asyncio.Event | None = None) -> str | None:
    """Run an engine until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None); returns why
    it could not go on, if so (a node of its multi-node group went away)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with engine:
        ends: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
        if engine.group is not None:
            ends.append(engine.group.lost)
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        ends[0].cancel()
        lost = engine.group.lost if engine.group is not None else None
        return lost.result() if lost is not None and lost.done() else None


def run(settings: EngineSettings) -> int:
    """The process's exit status: rank 0 (the engine) or a rank >= 1 of a multi-node instance."""
    if settings.node_rank >= 1:
        return _loop(
            group.follow(
                rank=settings.node_rank,
                nnodes=settings.nnodes,
                leader=parse_address(settings.dist_init_addr or ""),
                host=settings.host,
                port=settings.port,
                model_load_seconds=settings.model_load_seconds,
            )
        )
    try:
        engine = FakeEngine(settings)
    except ValueError as err:  # bad settings or profile: say why, no traceback
        raise SystemExit(f"prfaas-engine-sim: {err}") from None
    lost = _loop(serve(engine))
    if lost is not None:
        log.error("%s; the engine stops (as SGLang's schedulers fail their next broadcast)", lost)
        return 1
    return 0


def _loop(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main(argv: Sequence[str] | None = None) -> None:
    settings, namespace, unknown = parse_args(argv)
    logging.basicConfig(
        level=namespace.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if unknown:
        log.warning("ignoring arguments the fake engine does not know: %s", " ".join(unknown))
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # SGLang's exposition has no *_created series
    raise SystemExit(run(settings))


if __name__ == "__main__":
    main()
