"""The Gateway API Inference Extension's InferencePool CRD on a testbed cluster, as a gateway's
install puts it there: the file its pinned release ships (scripts/fetch-inference-pool-crd.sh),
installed for a test and removed afterwards, so that the operator's tests of a cluster without
the kind find none (the CRD is the gateway's to install, never the operator's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import yaml
from lightkube import ApiError, Client
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.types import PatchType
from prfaas_core.vocabulary import INFERENCE_POOL_GROUP, INFERENCE_POOL_PLURAL
from prfaas_operator.adapters.kube import InferencePoolResource

from prfaas_testbed.fetched import fetched
from prfaas_testbed.polling import eventually

FIELD_MANAGER = "prfaas-testbed"
CRD_NAME = f"{INFERENCE_POOL_PLURAL}.{INFERENCE_POOL_GROUP}"


def fetch_inference_pool_crd() -> dict[str, Any]:
    """The CRD document of the pinned release (downloaded once into a cache); RuntimeError if it
    cannot be had."""
    path = fetched("fetch-inference-pool-crd.sh", "InferencePool CRD")
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


def _gone(client: Client) -> bool:
    try:
        client.get(CustomResourceDefinition, CRD_NAME)
    except ApiError as err:
        if err.status.code == 404:
            return True
        raise
    return False


def _listable(client: Client) -> bool:
    """Established comes before the apiserver stores the kind: a list answers 429 ("storage is
    (re)initializing") for a moment, and an operator that listed it then would try again only
    after its add-on recheck."""
    try:
        list(client.list(InferencePoolResource, namespace="*"))
    except ApiError:
        return False
    return True


@contextlib.contextmanager
def inference_pool_crd(client: Client, timeout_s: float = 60) -> Iterator[None]:
    """The CRD installed and listable while inside; deleted (and gone) after. AssertionError if it
    is installed already: its owner would lose it when this ends."""
    assert _gone(client), f"{CRD_NAME} is installed already"
    client.patch(
        CustomResourceDefinition,
        CRD_NAME,
        fetch_inference_pool_crd(),
        patch_type=PatchType.APPLY,
        field_manager=FIELD_MANAGER,
    )
    try:
        eventually(lambda: _listable(client), timeout=timeout_s, interval=0.2, what=f"{CRD_NAME} listed")
        yield
    finally:
        with contextlib.suppress(ApiError):
            client.delete(CustomResourceDefinition, CRD_NAME)
        eventually(lambda: _gone(client), timeout=timeout_s, interval=0.2, what=f"{CRD_NAME} deleted")
