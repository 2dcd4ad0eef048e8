"""The router trusts nothing it is told: configs and engines that lie (issue 22).

Real router processes on loopback, real config files, misbehaving engines on raw sockets
(`faulty_engine.py`). Each broken case of the issue is a test here; each degraded one has its
bound. Only the engine that misbehaved is blamed; a refused report or config never stops the router.
"""

from __future__ import annotations

import time

import aiohttp
import pytest
from router_harness import (
    SHORT,
    Cluster,
    RouterFactory,
    chat,
    config_doc,
    http_get,
    post,
    wait_until,
)
from test_router_faults import CHAT_PATH, router_log

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------ configs that lie

UNUSABLE_AT_START = [
    "http://127.0.0.1:99999",
    "http://127.0.0.1:abc",
    "http://\u20ac@127.0.0.1:8000",
    "http://127.0.0.1:8000\r\nX-Smuggled: 1",
]
UNUSABLE_AT_RELOAD = {
    "http://[::1:8000": "Invalid IPv6",
    "http://:30000": "host is not",
    "http://admin:s3cret@127.0.0.1:8000": "credentials",
}


@pytest.mark.parametrize("url", UNUSABLE_AT_START)
async def test_an_unusable_endpoint_url_is_refused_and_the_router_runs_on(
    url: str, cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    """Broken 1: a URL that passed validation stopped the router on every start (its health loop
    raised); one refused at hot reload left `last_error` empty."""
    bad = config_doc(cluster.prfaas, cluster.local, [{"name": "bad", "url": url}, *cluster.decode])
    router = start_router(bad, wait_ready=False)
    time.sleep(1.5)  # past the first health, load and link polls
    assert router.process.popen is not None and router.process.popen.poll() is None, router.process.log()
    page = router.config_page()
    assert page["version"] is None and "pools.decode.0.url" in page["last_error"], page

    router.write_config(config_doc(cluster.prfaas, cluster.local, cluster.decode, version=2))
    wait_until(lambda: http_get(router.url, "/readiness")[0] == 200, "router ready on a good config")
    for version, (later, why) in enumerate(UNUSABLE_AT_RELOAD.items(), start=3):
        doc = config_doc(
            cluster.prfaas, cluster.local, [*cluster.decode, {"name": "bad", "url": later}], version=version
        )
        router.write_config(doc)
        wait_until(lambda why=why: why in str(router.config_page()["last_error"]), f"refusal of {later!r}", 5)
        page = router.config_page()
        assert "pools.decode.1.url" in page["last_error"], page
        assert page["version"] == 2 and "keeping version 2" in page["last_error"], page
    answer = await post(client, router.url + CHAT_PATH, chat(SHORT))
    assert answer.status == 200, answer.body
    assert router.process.popen.poll() is None
    shown = str(router.config_page()) + router_log(router)
    assert "s3cret" not in shown and "background loop" not in shown and "Traceback" not in shown
