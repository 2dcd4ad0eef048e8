"""The one trace reader (`prfaas_core.trace`) that the planner's workload and the simulator share."""

from __future__ import annotations

import pytest
from prfaas_core.trace import TraceError, TraceRecord, read_trace


def test_records_keep_their_line_and_leave_absent_fields_none() -> None:
    lines = [
        '{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [0, 2]}\n',
        "\n",
        '{"input_length": 9, "output_length": 1}\n',
    ]
    assert list(read_trace(lines, "t.jsonl")) == [
        TraceRecord(1, 5.0, 700, 3, (0, 2)),
        TraceRecord(3, None, 9, 1, None),
    ]


def test_a_timed_read_needs_every_timestamp() -> None:
    with pytest.raises(TraceError, match="line 1: timestamp must be a non-negative number"):
        list(read_trace(['{"input_length": 9, "output_length": 1}'], "t.jsonl", timed=True))
