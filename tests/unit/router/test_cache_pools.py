"""What counts as a Mooncake master serving: only its own healthy answer."""

from __future__ import annotations

import json

import pytest
from prfaas_router.cache_pools import serving

HEALTHY = {
    "status": "ok",
    "role": "leader",
    "ha_state": "serving",
    "service_ready": True,
    "leader_address": None,
    "view_version": None,
}


def test_the_masters_healthy_answer_is_serving() -> None:
    assert serving(200, json.dumps(HEALTHY).encode()) is None
    assert serving(200, b'{"status":"ok"}') is None  # a master without HA says no more


@pytest.mark.parametrize(
    ("status", "body", "why"),
    [
        (503, json.dumps(HEALTHY).encode(), "HTTP 503"),
        (200, b"", "not JSON"),
        (200, b"OK", "not JSON"),
        (200, b"\xff\xfe", "not JSON"),
        (200, b"[1]", "not a JSON object"),
        (200, json.dumps({**HEALTHY, "status": "degraded"}).encode(), "status"),
        (200, json.dumps({**HEALTHY, "service_ready": False}).encode(), "service_ready"),
        (200, json.dumps({**HEALTHY, "service_ready": "true"}).encode(), "service_ready"),
        (200, json.dumps({**HEALTHY, "ha_state": "recovering"}).encode(), "ha_state"),
    ],
)
def test_anything_else_is_down_and_says_why(status: int, body: bytes, why: str) -> None:
    problem = serving(status, body)
    assert problem is not None and why in problem
