"""The one way the tests read server-sent events: `data: ` lines, "[DONE]" as is, any other data as JSON."""

from __future__ import annotations

import json
from typing import Any

DATA = "data: "


def sse_event(line: str) -> Any | None:
    """The event of one `data: ` line ("[DONE]" as is, any other data parsed as JSON), None for
    any other line (a blank one, a comment)."""
    if not line.startswith(DATA):
        return None
    data = line.removeprefix(DATA)
    return data if data == "[DONE]" else json.loads(data)


def sse_events(text: str) -> list[Any]:
    """The events of a whole event-stream body: blocks of one `data: ` line each (anything else
    fails the test)."""
    events = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith(DATA), block
            events.append(sse_event(block))
    return events
