"""support.sse: the one reader of server-sent events the tests share."""

from __future__ import annotations

import pytest
from support.sse import sse_event, sse_events


def test_a_data_line_is_its_json_and_done_stays_a_string() -> None:
    assert sse_event('data: {"text": "a"}') == {"text": "a"}
    assert sse_event("data: [DONE]") == "[DONE]"


def test_any_other_line_is_no_event() -> None:
    assert sse_event("") is None
    assert sse_event(": keep-alive") is None


def test_a_body_is_its_events_in_order() -> None:
    body = 'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    assert sse_events(body) == [{"n": 1}, {"n": 2}, "[DONE]"]


def test_a_block_that_is_no_data_line_fails() -> None:
    with pytest.raises(AssertionError, match="event: ping"):
        sse_events("event: ping\n\n")
