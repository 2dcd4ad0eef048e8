"""The fake engine's pure parts: profiles, timing, the prefix cache, the token bucket, parsing, the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from prfaas_core.profiles import PrefillTimeModel, ProfileError
from prfaas_core.throughput.profile_file import parse_profile
from prfaas_engine_sim import protocol as proto
from prfaas_engine_sim.kv_transfer import TokenBucket
from prfaas_engine_sim.metrics import GAUGES, EngineMetrics
from prfaas_engine_sim.prefix_cache import PrefixCache, block_keys_for_ids, block_keys_for_text
from prfaas_engine_sim.settings import (
    EngineSettings,
    PdTimeouts,
    health_check_timeout_from,
    health_endpoint_generation_from,
    parse_args,
)
from prfaas_engine_sim.timing import (
    CASE_STUDY_ENV,
    EMBEDDED_CASE_STUDY,
    chunk_ends,
    kv_wire_bytes,
    load_profile,
    prefill_batch_seconds,
    text_tokens,
)

GAUGE_NAMES = list(GAUGES)
REPO_CASE_STUDY = Path(__file__).resolve().parents[3] / "data" / "profiles" / "case-study.yaml"


# ----------------------------------------------------------------------------- profiles and timing


def test_embedded_case_study_points_equal_the_repository_data_file() -> None:
    shared = yaml.safe_load(REPO_CASE_STUDY.read_text())
    assert shared["model"]["kv_cache_points"] == EMBEDDED_CASE_STUDY["model"]["kv_cache_points"]
    for name, hardware in EMBEDDED_CASE_STUDY["hardware"].items():
        assert shared["hardware"][name]["prefill_seconds_points"] == hardware["prefill_seconds_points"]
        assert shared["hardware"][name].get("decode") == hardware.get("decode")


def test_builtin_profiles_fit_the_case_study_points() -> None:
    h200, h20 = load_profile("h200"), load_profile("h20")
    assert h200.prefill_time.seconds_for(131072.0) == pytest.approx(7.40, rel=0.01)
    assert h20.prefill_time.seconds_for(131072.0) == pytest.approx(26.814, rel=0.01)
    assert h200.kv_size is not None and h200.kv_size.bytes_for(131072.0) == pytest.approx(
        2316.3 * 2**20, rel=0.01
    )
    assert h200.decode is None  # the case study's H200s only prefill
    assert h20.decode is not None and (h20.decode.max_batch, h20.decode.step_seconds) == (20, 0.025)


def test_the_engines_time_by_the_curves_the_planner_plans_with() -> None:
    planner = parse_profile(REPO_CASE_STUDY.read_text()).system_profile(prfaas_gpu="h200", pd_gpu="h20")
    h200, h20 = load_profile(f"{REPO_CASE_STUDY}#h200"), load_profile(f"{REPO_CASE_STUDY}#h20")
    assert h200.prefill_time == planner.prfaas_prefill
    assert h20.prefill_time == planner.pd_prefill
    assert h20.kv_size == planner.kv_size
    assert h20.decode == planner.decode


def test_case_study_file_from_the_environment_replaces_the_embedded_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = {
        "hardware": {
            "h20": {"prefill_seconds_points": [{"tokens": t, "seconds": t / 1000} for t in (10, 20, 40)]}
        }
    }
    path = tmp_path / "case.yaml"
    path.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv(CASE_STUDY_ENV, str(path))
    assert load_profile("h20").prefill_time.seconds_for(30.0) == pytest.approx(0.03)
    monkeypatch.setenv(CASE_STUDY_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(ProfileError, match="not a readable file"):
        load_profile("h20")


def test_profile_files_flat_and_sectioned(tmp_path: Path) -> None:
    flat = tmp_path / "flat.yaml"
    flat.write_text(
        yaml.safe_dump(
            {
                "prefill_seconds_points": [{"tokens": t, "seconds": 0.1 + t / 1000} for t in (100, 200, 400)],
                "kv_cache_points": [{"tokens": 100, "bytes": 1000}, {"tokens": 200, "bytes": 2000}],
                "decode": {"max_batch": 4, "step_seconds": 0.01},
            }
        )
    )
    profile = load_profile(str(flat))
    assert profile.name == "flat" and profile.decode is not None and profile.decode.max_batch == 4
    assert profile.kv_size is not None and profile.kv_size.bytes_per_token == pytest.approx(10.0)

    sectioned = tmp_path / "sectioned.yaml"
    sectioned.write_text(yaml.safe_dump(EMBEDDED_CASE_STUDY))
    assert load_profile(f"{sectioned}#h200").prefill_time == load_profile("h200").prefill_time
    with pytest.raises(ProfileError, match="no hardware named 'b300'"):
        load_profile(f"{sectioned}#b300")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"prefill_seconds_points": [{"tokens": 1, "seconds": 1}]}, "at least 3"),
        ({"prefill_seconds_points": [{"tokens": 1}, {"tokens": 2}, {"tokens": 3}]}, "exactly one of"),
        ({"prefill_seconds_points": "fast"}, "expected a list"),
        ({"decode": {"max_batch": 2}}, "no prefill_seconds_points"),
        ([1, 2], "must be a YAML mapping"),
    ],
)
def test_bad_profile_files_are_refused_with_the_cause(tmp_path: Path, doc: Any, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ProfileError, match=message):
        load_profile(str(path))


def test_unknown_profile_names_the_choices() -> None:
    with pytest.raises(ProfileError, match="neither a built-in"):
        load_profile("b300")


def test_a_batch_pays_the_launch_overhead_once() -> None:
    model = PrefillTimeModel(c0=0.4, c1=1e-4, c2=1e-9)
    assert prefill_batch_seconds(model, [1000]) == pytest.approx(model.seconds_for(1000.0))
    together = prefill_batch_seconds(model, [1000, 3000])
    assert together == pytest.approx(model.seconds_for(1000.0) + model.seconds_for(3000.0) - model.c0)
    assert prefill_batch_seconds(model, [0]) == pytest.approx(model.seconds_for(1.0))  # at least one token
    with pytest.raises(ValueError, match="at least one request"):
        prefill_batch_seconds(model, [])


def test_kv_wire_bytes_and_text_tokens() -> None:
    kv = load_profile("h200").kv_size
    assert kv is not None
    assert kv_wire_bytes(kv, 1024, 1e-3) == round(kv.bytes_for(1024.0) * 1e-3)
    assert kv_wire_bytes(kv, 1024, 0.0) == 0
    assert text_tokens("abcde", 4.0) == 2


def test_chunks_end_where_a_prompt_of_their_length_would_be_computed() -> None:
    model = load_profile("h200").prefill_time
    whole = model.seconds_for(20000.0)
    assert chunk_ends(model, 20000, 8192) == [
        (pytest.approx(model.seconds_for(8192.0) / whole), 8192),
        (pytest.approx(model.seconds_for(16384.0) / whole), 16384),
        (1.0, 20000),
    ]
    assert chunk_ends(model, 8192, 8192) == [(1.0, 8192)]  # one chunk: all KV at the forward's end
    assert chunk_ends(model, 0, 8192) == [(1.0, 1)]  # a fully cached prompt still computes one token


# ----------------------------------------------------------------------------- prefix cache and token bucket


def test_prefix_cache_matches_chained_prefixes_and_evicts_least_recently_used() -> None:
    cache = PrefixCache(block_tokens=4, max_tokens=12)  # three blocks
    first = block_keys_for_ids(list(range(10)), 4)
    assert len(first) == 2  # the partial last block is never cached
    assert cache.match(first) == 0
    cache.insert(first)
    assert cache.match(block_keys_for_ids(list(range(8)) + [99] * 4, 4)) == 2
    changed_first_block = [99, *range(1, 12)]
    assert cache.match(block_keys_for_ids(changed_first_block, 4)) == 0  # the chain breaks at block 0

    other = block_keys_for_ids([7] * 8, 4)
    cache.match(first)  # first becomes most recently used
    cache.insert(other)  # four blocks do not fit three: the oldest goes
    assert len(cache) == 3 and cache.cached_tokens == 12
    assert cache.match(other) == 2
    cache.clear()
    assert cache.match(other) == 0


def test_text_blocks_are_fixed_character_spans() -> None:
    assert block_keys_for_text("abcdefgh" * 2, 8)[0] == block_keys_for_text("abcdefgh", 8)[0]
    assert block_keys_for_text("abc", 8) == []
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixCache(block_tokens=64, max_tokens=10)


def test_a_salted_prompt_shares_no_block_with_another_salt_or_none() -> None:
    cache = PrefixCache(block_tokens=4, max_tokens=64)
    ids, text = list(range(8)), "abcdefgh" * 2
    cache.insert(block_keys_for_ids(ids, 4, "a") + block_keys_for_text(text, 8, "a"))
    for salt in ("b", None):
        assert cache.match(block_keys_for_ids(ids, 4, salt)) == 0
        assert cache.match(block_keys_for_text(text, 8, salt)) == 0
    assert cache.match(block_keys_for_ids(ids, 4, "a")) == 2
    assert cache.match(block_keys_for_text(text, 8, "a")) == 2


def test_token_bucket_paces_the_aggregate_and_allows_one_burst() -> None:
    bucket = TokenBucket(rate_bytes_per_second=1000.0, burst_bytes=100.0)
    assert bucket.reserve(100, now=10.0) == 0.0  # the burst goes out at once after idling
    assert bucket.reserve(500, now=10.0) == pytest.approx(0.5)
    assert bucket.reserve(500, now=10.0) == pytest.approx(1.0)  # queued behind the previous reservation
    assert bucket.reserve(1000, now=20.0) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="positive rate"):
        TokenBucket(0.0, 1.0)


# ----------------------------------------------------------------------------- request parsing

OPTIONS = proto.ParseOptions(
    chars_per_token=4.0, default_max_new_tokens=16, context_length=1000, required_bootstrap_mode="decode"
)


def test_batched_generate_takes_one_room_per_item() -> None:
    body = {
        "input_ids": [[1, 2, 3], [4, 5]],
        "sampling_params": {"max_new_tokens": 7},
        "bootstrap_host": ["10.0.0.1", "10.0.0.1"],
        "bootstrap_port": [8998, None],
        "bootstrap_room": [1, 2],
    }
    parsed = proto.parse_generate(body, OPTIONS)
    assert parsed.batched and [item.prompt.tokens for item in parsed.items] == [3, 2]
    assert [item.bootstrap for item in parsed.items] == [
        proto.BootstrapTarget("10.0.0.1", 8998, 1),
        proto.BootstrapTarget("10.0.0.1", None, 2),
    ]
    assert all(item.max_new_tokens == 7 for item in parsed.items)


def test_rooms_and_copies_as_sglang_expands_them() -> None:
    """io_struct.py: a room list gives every copy of prompt i room i, a number gives prompt i
    room + i; with n > 1 each prompt's warm-up (max_new_tokens 0) carries the same room."""
    common = {"bootstrap_host": "10.0.0.1", "sampling_params": {"n": 2, "max_new_tokens": 3}}
    parsed = proto.parse_generate({"text": ["aaaa", "bbbbbbbb"], "bootstrap_room": [5, 9], **common}, OPTIONS)
    assert parsed.batched
    assert [(item.bootstrap and item.bootstrap.room, item.prompt_index) for item in parsed.items] == [
        (5, 0),
        (5, 0),
        (9, 1),
        (9, 1),
    ]
    assert [(item.bootstrap and item.bootstrap.room, item.max_new_tokens) for item in parsed.warmups] == [
        (5, 0),
        (9, 0),
    ]
    single = proto.parse_generate({"text": "aaaa", "bootstrap_room": 7, **common}, OPTIONS)
    assert single.batched and [item.bootstrap and item.bootstrap.room for item in single.items] == [7, 7]
    assert [item.bootstrap and item.bootstrap.room for item in single.warmups] == [7]
    plain = proto.parse_generate({"text": ["a", "b"], "bootstrap_host": "h", "bootstrap_room": 7}, OPTIONS)
    assert [item.bootstrap and item.bootstrap.room for item in plain.items] == [7, 8]
    assert plain.warmups == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": "hi"}, "bootstrap_room is required in DECODE mode"),
        ({"text": "hi", "bootstrap_room": 1}, "bootstrap_host is required"),
        ({"text": ["a", "b"], "bootstrap_host": "h", "bootstrap_room": [1]}, "1 values for 2 prompts"),
        (
            {
                "text": ["a", "b"],
                "bootstrap_host": "h",
                "bootstrap_room": [1, 2],
                "sampling_params": [{"n": 2}, {}],
            },
            "parallel_sample_num should be the same",
        ),
        ({"text": "hi", "bootstrap_host": "h", "bootstrap_room": -1}, "bootstrap_room must be an integer"),
        ({"text": "hi", "bootstrap_host": "h", "bootstrap_room": 1, "bootstrap_port": 0}, "bootstrap_port"),
        ({"text": "hi", "input_ids": [1]}, "exactly one of them"),
        ({"text": ""}, "text is empty"),
        ({"input_ids": [1, "x"]}, "token ids"),
        ({"text": "a" * 4000, "bootstrap_host": "h", "bootstrap_room": 1}, "context length"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
        ([1, 2], "JSON object"),
    ],
)
def test_generate_refuses_bad_bodies_with_the_cause(body: Any, message: str) -> None:
    with pytest.raises(proto.RequestError, match=message):
        proto.parse_generate(body, OPTIONS)


def test_cache_salts_per_prompt_as_sglang_normalizes_them() -> None:
    plain = proto.ParseOptions(4.0, 16, 1000, None)  # no PD mode: no bootstrap fields needed
    salts = [
        item.prompt.cache_salt
        for item in proto.parse_generate({"text": ["a", "b", "c"], "cache_salt": ["x", "", "y"]}, plain).items
    ]
    assert salts == ["x", None, "y"]  # an empty salt is none
    one = proto.parse_generate({"text": ["a", "b"], "cache_salt": "x", "sampling_params": {"n": 2}}, plain)
    assert [item.prompt.cache_salt for item in (*one.items, *one.warmups)] == ["x"] * 6
    assert (
        proto.parse_completions({"prompt": "a", "cache_salt": "z"}, plain).items[0].prompt.cache_salt == "z"
    )
    with pytest.raises(proto.RequestError, match="cache_salt"):
        proto.parse_generate({"text": "a", "cache_salt": 5}, plain)
    with pytest.raises(proto.RequestError, match="cache_salt has 1 values for a batch of 2"):
        proto.parse_generate({"text": ["a", "b"], "cache_salt": ["x"]}, plain)


def test_chat_counts_the_concatenated_message_text_and_n_choices() -> None:
    options = proto.ParseOptions(4.0, 16, 1000, None)
    body = {
        "messages": [
            {"role": "system", "content": "abcd"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "efgh"}, {"type": "image_url", "image_url": {}}],
            },
        ],
        "n": 2,
        "max_completion_tokens": 3,
        "bootstrap_room": "ignored outside PD",
    }
    parsed = proto.parse_chat(body, options)
    assert [(item.prompt.tokens, item.max_new_tokens) for item in parsed.warmups] == [(2, 0)]
    assert [item.prompt.tokens for item in parsed.items] == [2, 2]
    assert [item.prompt_index for item in parsed.items] == [0, 0]
    assert all(item.bootstrap is None and item.max_new_tokens == 3 for item in parsed.items)
    results = [proto.ItemResult(2, 1, 3, 0.1), proto.ItemResult(2, 1, 3, 0.1)]
    assert proto.usage(parsed.items, results) == {
        "prompt_tokens": 2,
        "completion_tokens": 6,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_stream_token_chunks_are_valid_openai_json() -> None:
    import json

    formatter = proto.StreamFormatter(proto.Api.CHAT, "rid-1", 'model "quoted"', 5, batched=False)
    event = formatter.token("rid-1", 0, 3, prompt_tokens=10, cached=0)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    chunk = json.loads(event[6:])
    assert chunk["choices"][0]["delta"] == {"content": proto.token_text(3)}
    assert chunk["model"] == 'model "quoted"'


# ----------------------------------------------------------------------------- CLI


def test_sglang_launch_arguments_map_onto_the_settings() -> None:
    settings, namespace, unknown = parse_args(
        [
            *(
                "--model-path",
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "10.0.0.5",
                "--port",
                "8000",
            ),
            *("--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", "9000"),
            *(
                "--disaggregation-transfer-backend",
                "nixl",
                "--page-size",
                "16",
                "--kv-cache-dtype",
                "fp8_e4m3",
            ),
            *("--tp-size", "8", "--enable-metrics", "--trust-remote-code", "--revision", "abc"),
            *("--max-running-requests", "32", "--mem-fraction-static", "0.9", "--schedule-policy", "lpm"),
        ]
    )
    assert unknown == ["--schedule-policy", "lpm"]
    assert namespace.revision == "abc"
    assert (settings.mode, settings.host, settings.port, settings.bootstrap_port) == (
        "decode",
        "10.0.0.5",
        8000,
        9000,
    )
    assert (settings.model_path, settings.model_name, settings.transfer_backend) == ("/models/m", "m", "nixl")
    assert (settings.page_size, settings.kv_cache_dtype, settings.tp_size) == (16, "fp8_e4m3", 8)
    assert settings.max_decode_batch == 32


def test_our_own_option_names_and_defaults() -> None:
    settings, _, unknown = parse_args(
        ["--mode", "prefill", "--bootstrap-port", "7000", "--time-scale", "0", "--kv-scale", "0.01"]
    )
    assert unknown == []
    assert (settings.mode, settings.bootstrap_port, settings.time_scale, settings.kv_scale) == (
        "prefill",
        7000,
        0,
        0.01,
    )
    assert (settings.port, settings.profile, settings.model_name) == (30000, "h20", settings.model_path)


def test_bad_settings_name_every_cause() -> None:
    with pytest.raises(ValueError, match=r"time_scale must be >= 0.*chars_per_token must be > 0"):
        EngineSettings(time_scale=-1, chars_per_token=0)
    with pytest.raises(ValueError, match="kv_fixed_bytes needs kv_bytes_per_token"):
        EngineSettings(kv_fixed_bytes=10)


def test_health_settings_come_from_sglangs_environment_variables_as_it_parses_them() -> None:
    assert health_endpoint_generation_from({}) is True
    assert health_endpoint_generation_from({"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "False"}) is False
    assert health_endpoint_generation_from({"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "y"}) is True
    with pytest.raises(ValueError, match="not a valid boolean"):
        health_endpoint_generation_from({"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "off"})
    assert health_check_timeout_from({}) == 20.0
    assert health_check_timeout_from({"SGLANG_HEALTH_CHECK_TIMEOUT": "7"}) == 7.0
    settings, _, _ = parse_args([])
    assert (settings.health_generation_delay, settings.health_check_timeout) == (1.0, 20.0)


def test_pd_timeouts_are_sglangs_scaled_with_floors_unless_set() -> None:
    assert EngineSettings().pd_timeouts == PdTimeouts(300.0, 300.0, 5.0, 2, 1.0, 15)
    assert EngineSettings(time_scale=0).pd_timeouts == PdTimeouts(300.0, 300.0, 5.0, 2, 0.0, 15)
    assert EngineSettings(time_scale=0.1).pd_timeouts == PdTimeouts(30.0, 30.0, 1.0, 2, 0.1, 15)
    fast = EngineSettings(time_scale=0.02)
    assert fast.pd_timeouts == PdTimeouts(6.0, 6.0, 1.0, 2, 0.02, 15)
    assert fast.pd_timeouts.silence == 2.0
    explicit = EngineSettings(
        time_scale=0.02, bootstrap_timeout=0.5, kv_heartbeat_seconds=0.2, kv_heartbeat_max_failures=3
    )
    assert explicit.pd_timeouts == PdTimeouts(0.5, 6.0, 0.2, 3, 0.02, 15)
    settings, _, _ = parse_args(
        ["--chunked-prefill-size", "4096", "--waiting-timeout", "9", "--kv-heartbeat-max-failures", "4"]
    )
    assert (settings.chunked_prefill_size, settings.pd_timeouts.waiting) == (4096, 9.0)
    assert settings.pd_timeouts.heartbeat_max_failures == 4
    assert EngineSettings().chunked_prefill_size == 8192


def _samples(metrics: EngineMetrics, name: str) -> dict[frozenset[tuple[str, str]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        frozenset(sample.labels.items()): sample.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for sample in family.samples
        if sample.name == name
    }


def test_every_tp_rank_observes_its_shard_of_a_transfer_and_rank_zero_alone_the_gauges() -> None:
    metrics = EngineMetrics("m", "prefill", lambda: dict.fromkeys(GAUGE_NAMES, 1.0), tp_size=2, dp_size=1)
    speed = metrics.observe_transfer(room=3, kv_bytes=4 * 2**20, seconds=0.5)
    assert speed == pytest.approx(2 / 1024 / 0.5)  # rank 0's 2 MiB over 0.5 s, in GiB/s

    def ranked(tp_rank: str) -> frozenset[tuple[str, str]]:
        labels = {
            "model_name": "m",
            "engine_type": "prefill",
            "tp_rank": tp_rank,
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        return frozenset(labels.items())

    assert _samples(metrics, "sglang:kv_transfer_total_mb_sum") == {ranked("0"): 2.0, ranked("1"): 2.0}
    assert _samples(metrics, "sglang:kv_transfer_latency_ms_sum") == {ranked("0"): 500.0, ranked("1"): 500.0}
    assert _samples(metrics, "sglang:kv_transfer_latency_ms_count") == {ranked("0"): 1.0, ranked("1"): 1.0}
    assert _samples(metrics, "sglang:num_running_reqs") == {ranked("0"): 1.0}
    metrics.count_failure(metrics.transfer_failed, room=3)
    assert _samples(metrics, "sglang:num_transfer_failed_reqs_total") == {ranked("0"): 1.0, ranked("1"): 1.0}
    metrics.observe_finished(
        prompt_tokens=5, cached_tokens=0, generation_tokens=2, e2e_seconds=0.1, streaming=True
    )
    assert _samples(metrics, "sglang:num_requests_total") == {
        frozenset({"model_name": "m", "engine_type": "prefill", "is_streaming": "true"}.items()): 1.0
    }


def test_a_rooms_transfer_runs_on_dp_rank_room_mod_dp_size() -> None:
    metrics = EngineMetrics("m", "prefill", lambda: dict.fromkeys(GAUGE_NAMES, 0.0), tp_size=1, dp_size=2)
    metrics.observe_transfer(room=3, kv_bytes=2**20, seconds=0.1)
    (labels,) = _samples(metrics, "sglang:kv_transfer_total_mb_count")
    assert dict(labels)["dp_rank"] == "1" and dict(labels)["tp_rank"] == "0"
