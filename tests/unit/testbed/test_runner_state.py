"""The runner's files: control.json holds a cluster or one pod down; status.json lists the pods."""

from __future__ import annotations

import json
from pathlib import Path

from prfaas_testbed.clusters import Cluster
from prfaas_testbed.link import LinkMode
from prfaas_testbed.pod_workloads import PodFacts, Scales
from prfaas_testbed.runner_state import CONTROL_FILE, STATUS_FILE, is_held_down, read_control, write_status


def facts(namespace: str, name: str) -> PodFacts:
    pod = {
        "metadata": {"namespace": namespace, "name": name, "uid": "u"},
        "spec": {"containers": [{"name": "main"}]},
        "status": {"podIP": "10.0.0.1"},
    }
    return PodFacts.of(pod, None)


def test_control_holds_down_a_whole_cluster_or_one_pod(tmp_path: Path) -> None:
    assert read_control(tmp_path) == {}  # no file: nothing held down
    (tmp_path / CONTROL_FILE).write_text("{not json")
    assert read_control(tmp_path) == {}  # unreadable: ignored, not fatal
    (tmp_path / CONTROL_FILE).write_text(json.dumps({"down": ["prfaas", "pd/demo/engine-0"]}))
    control = read_control(tmp_path)
    assert is_held_down(control, Cluster.PRFAAS, facts("demo", "anything"))
    assert is_held_down(control, Cluster.PD, facts("demo", "engine-0"))
    assert not is_held_down(control, Cluster.PD, facts("demo", "engine-1"))


def test_status_lists_the_pods_sorted_with_the_link_mode_and_scales(tmp_path: Path) -> None:
    pods = [
        {"cluster": "pd", "namespace": "b", "pod": "x"},
        {"cluster": "pd", "namespace": "a", "pod": "y"},
    ]
    write_status(tmp_path, LinkMode.ENGINE_TOKEN_BUCKET, Scales(time_scale=0.5, kv_scale=0.01), pods)
    status = json.loads((tmp_path / STATUS_FILE).read_text())
    assert status["link_mode"] == LinkMode.ENGINE_TOKEN_BUCKET.value
    assert status["scales"] == {"time_scale": 0.5, "kv_scale": 0.01}
    assert [p["namespace"] for p in status["pods"]] == ["a", "b"]
