"""The KV page size: only what SGLang accepts for a hybrid linear-attention prefill (issue 19).

SGLang's own verdict on each size is in tests/conformance; here, the model and the CRD agree.
"""

from __future__ import annotations

from typing import get_args

import pytest
from prfaas_operator import api, crd
from pydantic import ValidationError
from support.sample_cr import spec


@pytest.mark.parametrize("size", [1, 64, 256])
def test_divisors_of_the_mamba_track_interval_are_accepted(size: int) -> None:
    assert spec(**{"model.kv.pageSize": size}).model.kv.page_size == size


@pytest.mark.parametrize("size", [0, 3, 48, 512, 4096])
def test_sizes_sglang_asserts_on_are_refused(size: int) -> None:
    with pytest.raises(ValidationError, match=r"page_?[sS]ize"):
        spec(**{"model.kv.pageSize": size})


def test_the_crd_refuses_them_too_and_explains_why() -> None:
    kv = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["model"]["properties"]["kv"]["properties"]["pageSize"]
    assert kv["type"] == "integer" and kv["enum"] == list(get_args(api.PageSize)) and kv["default"] == 64
    assert all(256 % size == 0 for size in kv["enum"])
    assert "mamba-track-interval" in kv["description"] and "validate_mamba_extra_buffer" in kv["description"]
