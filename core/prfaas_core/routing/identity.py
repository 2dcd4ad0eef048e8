"""Whether the engine answering at an endpoint's address is the one the config lists (pure).

The operator lists an engine it can no longer observe (its cluster's apiserver is away) from its
last observation for a bounded time (`Endpoint.unobserved_since`). In that time its pod may have
gone and its IP been given to another pod. The router then asks the address's `/server_info`
(SGLang 0.5.23: `build_server_info`, the resolved server args) and routes there only while the
answer is the engine the operator started: the served model name, the disaggregation mode of its
pool and, for a prefill, the bootstrap port its KV handshake goes through, as the operator passes
them on the command line (`--served-model-name`, `--disaggregation-mode`,
`--disaggregation-bootstrap-port`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prfaas_core.vocabulary import Pool

SERVER_INFO_PATH = "/server_info"
SHOWN_CHARS = 80
"""Of a value the engine answered, what a reason shows: an engine that lies may answer anything."""


def expected_mode(pool: Pool) -> str:
    """SGLang's `disaggregation_mode` of an engine in `pool`."""
    return "decode" if pool is Pool.DECODE else "prefill"


def engine_identity_problem(
    server_info: Any, pool: Pool, served_model_name: str, bootstrap_port: int | None
) -> str | None:
    """Why `server_info` (the parsed JSON of `/server_info`) is not the engine listed, or None when it is."""
    if not isinstance(server_info, Mapping):
        return "its /server_info is not a JSON object"
    expected: dict[str, Any] = {
        "served_model_name": served_model_name,
        "disaggregation_mode": expected_mode(pool),
    }
    if pool is not Pool.DECODE:
        expected["disaggregation_bootstrap_port"] = bootstrap_port
    wrong = [
        f"{field} is {repr(server_info.get(field))[:SHOWN_CHARS]}, not {value!r}"
        for field, value in expected.items()
        if server_info.get(field) != value
    ]
    return "; ".join(wrong) or None
