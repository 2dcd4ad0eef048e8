"""Mooncake-style request traces: one JSON object per line, read into `TraceRecord`s (pure).

A record has `timestamp` (milliseconds), `input_length` and `output_length` (tokens) and
`hash_ids` (the prompt's prefix-chained block ids, `TRACE_BLOCK_TOKENS` tokens each). The
planner's workload reads the lengths and, for prefix reuse, the hash ids; the simulator replays
the timestamps too. The caller opens the file and passes its lines; blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

TRACE_BLOCK_TOKENS = 512
"""Mooncake traces hash prompts in 512-token prefix-chained blocks."""


class TraceError(ValueError):
    """A trace line that is not a request record; the message names the source and the line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace. `timestamp_ms` and `hash_ids` are None where the line has none."""

    line: int  # its line number in the file, for messages
    timestamp_ms: float | None
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None


def read_trace(lines: Iterable[str], source: str, *, timed: bool = False) -> Iterator[TraceRecord]:
    """The records of a trace's lines, in order; a malformed line raises TraceError.

    `timed`: every record must have its timestamp (a replay needs them; a length distribution not).
    """
    for number, line in enumerate(lines, start=1):
        if line.strip():
            yield _record(line, number, f"{source}: line {number}", timed)


def _record(line: str, number: int, where: str, timed: bool) -> TraceRecord:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object")
    stamp = data.get("timestamp")
    if (timed or stamp is not None) and (
        isinstance(stamp, bool) or not isinstance(stamp, int | float) or not stamp >= 0
    ):
        raise TraceError(f"{where}: timestamp must be a non-negative number of milliseconds, got {stamp!r}")
    lengths = []
    for key in ("input_length", "output_length"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TraceError(f"{where}: {key} must be a positive integer, got {value!r}")
        lengths.append(value)
    hashes = data.get("hash_ids")
    if hashes is not None and (
        not isinstance(hashes, list)
        or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hashes)
    ):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
    return TraceRecord(
        number,
        None if stamp is None else float(stamp),
        lengths[0],
        lengths[1],
        None if hashes is None else tuple(hashes),
    )
