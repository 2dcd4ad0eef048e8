"""Request validation, prompt extraction and the PD bootstrap fields."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prfaas_router.payloads import (
    ApiError,
    Kind,
    Limits,
    completion_tokens,
    engine_error,
    last_completion_tokens,
    parse,
    prompt_keys,
    request_id,
    with_bootstrap,
)


def error_of(kind: Kind, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(kind, raw)
    return caught.value


@pytest.mark.parametrize(
    ("kind", "raw", "param", "words"),
    [
        (Kind.CHAT, b"{not json", None, "not valid JSON"),
        (Kind.CHAT, b"[1, 2]", None, "JSON object"),
        (Kind.CHAT, b'{"messages": []}', "messages", "at least one message"),
        (Kind.CHAT, b'{"model": "m"}', "messages", "required"),
        (Kind.CHAT, b'{"messages": "hi"}', "messages", "array"),
        (Kind.CHAT, b'{"messages": [{"content": "hi"}]}', "messages[0].role", "role"),
        (Kind.CHAT, b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content", "string"),
        (
            Kind.CHAT,
            b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            "stream",
            "boolean",
        ),
        (Kind.CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": 7}', "model", "string"),
        (
            Kind.CHAT,
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
            "max_tokens",
            "integer",
        ),
        (Kind.CHAT, b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n", "positive"),
        (
            Kind.CHAT,
            b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
            "temperature",
            "number",
        ),
        (Kind.COMPLETION, b'{"model": "m"}', "prompt", "required"),
        (Kind.COMPLETION, b'{"prompt": ""}', "prompt", "empty"),
        (Kind.COMPLETION, b'{"prompt": []}', "prompt", "non-empty"),
        (Kind.COMPLETION, b'{"prompt": [1, "a"]}', "prompt", "token ids"),
        (Kind.COMPLETION, b'{"prompt": [[1], []]}', "prompt", "token id arrays"),
        (Kind.GENERATE, b'{"sampling_params": {}}', "text", "exactly one"),
        (Kind.GENERATE, b'{"text": "a", "input_ids": [1]}', "text", "exactly one"),
        (Kind.GENERATE, b'{"text": 3}', "text", "string"),
        (Kind.GENERATE, b'{"input_ids": [true]}', "input_ids", "token ids"),
        (Kind.GENERATE, b'{"text": "a", "sampling_params": []}', "sampling_params", "object"),
    ],
)
def test_bad_bodies_get_an_openai_error_naming_the_field(
    kind: Kind, raw: bytes, param: str | None, words: str
) -> None:
    error = error_of(kind, raw)
    assert error.status == 400 and error.param == param and words in error.message
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b'{"prompt": [1, 2]',
        b'{"prompt": [1]} and more',
        b"",
        b"\xff",
        b'{"prompt": "\xc3"}',
        b"[" * 5000,
    ],
)
def test_what_is_not_utf8_json_is_invalid_json(raw: bytes) -> None:
    error = error_of(Kind.COMPLETION, raw)
    assert (error.status, error.code, error.param) == (400, "invalid_json", None)
    assert "not valid JSON" in error.message


# besides the ids: nothing else; another array (as_buffer's fast path); a '[' in a string (the exact check)
OTHER_FIELDS = ["", ', "stop": ["\\n", "."]', ', "stop": "[", "n": 1']


@pytest.mark.parametrize(("kind", "field"), [(Kind.COMPLETION, "prompt"), (Kind.GENERATE, "input_ids")])
@pytest.mark.parametrize(
    "ids",
    [
        "[1, 2.5]",
        "[1, 2.0]",
        '[1, "2"]',
        "[1, true]",
        "[1, null]",
        '[1, {"a": 2}]',
        "[1, -1]",
        "[1, -9223372036854775809]",  # past int64: json decodes it, not simdjson
        "[1, 18446744073709551616]",  # past uint64
        "[1, [2], 3]",
        "[1, [2]]",  # as many ids as elements, nested all the same
        "[[1], 2]",
        "[[1], []]",
        "[[1], [[2]]]",
        "[[1], [2, 2.5]]",
    ],
)
@pytest.mark.parametrize("others", OTHER_FIELDS)
def test_token_ids_that_are_not_uint64s_are_refused_naming_the_field(
    kind: Kind, field: str, ids: str, others: str
) -> None:
    error = error_of(kind, f'{{"{field}": {ids}{others}}}'.encode())
    assert (error.status, error.param, error.code) == (400, field, "invalid_type")
    assert "token id" in error.message


@pytest.mark.parametrize("others", OTHER_FIELDS)
def test_token_ids_are_decoded_as_uint64_buffers(others: str) -> None:
    body, parsed = parse(Kind.COMPLETION, f'{{"prompt": [0, 7, {2**63}, {2**64 - 1}]{others}}}'.encode())
    (ids,) = parsed.token_ids
    assert ids.format == "Q" and ids.tolist() == [0, 7, 2**63, 2**64 - 1] and body["prompt"] is ids
    body, parsed = parse(Kind.GENERATE, f'{{"input_ids": [[1, 2], [3]]{others}}}'.encode())
    assert [ids.tolist() for ids in parsed.token_ids] == [[1, 2], [3]] and parsed.batch == 2
    assert body["input_ids"] == list(parsed.token_ids)


def test_later_duplicate_keys_win_as_in_json() -> None:
    raw = b'{"prompt": "text", "max_tokens": "x", "prompt": [1, 2], "max_tokens": 3, "stream": true}'
    body, parsed = parse(Kind.COMPLETION, raw)
    assert parsed.token_ids[0].tolist() == [1, 2] and not parsed.texts and body["max_tokens"] == 3
    assert list(body) == ["prompt", "max_tokens", "stream"]
    assert error_of(Kind.COMPLETION, b'{"prompt": [1], "prompt": [1, 2.5]}').param == "prompt"
    assert error_of(Kind.COMPLETION, b'{"prompt": [1], "n": 2, "n": 0}').param == "n"
    body, _ = parse(Kind.COMPLETION, b'{"n": 1, "n\\u0000": 2, "prompt": [1]}')  # no C-string lookups
    assert (body["n"], body["n\0"]) == (1, 2)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(alphabet=st.characters(), max_size=4),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=8,
)
token_ids = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=12)


@given(
    prompt=token_ids | st.lists(token_ids, min_size=1, max_size=3),
    others=st.dictionaries(st.text(max_size=4).filter(lambda name: name != "n"), json_values, max_size=4),
    earlier_prompt=st.none() | token_ids,
    ensure_ascii=st.booleans(),
)
def test_the_body_is_what_json_decodes_but_token_ids_are_buffers(
    prompt: list[int] | list[list[int]],
    others: dict[str, object],
    earlier_prompt: list[int] | None,
    ensure_ascii: bool,
) -> None:
    fields = [*([("prompt", earlier_prompt)] if earlier_prompt else []), *others.items(), ("prompt", prompt)]
    raw = (
        "{"
        + ",".join(
            f"{json.dumps(k, ensure_ascii=ensure_ascii)}:{json.dumps(v, ensure_ascii=ensure_ascii)}"
            for k, v in fields
        )
        + "}"
    ).encode(errors="surrogatepass")
    try:
        expected = json.loads(raw)
    except ValueError:  # a lone surrogate, unescaped: not UTF-8
        assert error_of(Kind.COMPLETION, raw).code == "invalid_json"
        return
    body, parsed = parse(Kind.COMPLETION, raw)
    rows = [prompt] if isinstance(prompt[0], int) else prompt
    assert [ids.tolist() for ids in parsed.token_ids] == rows
    decoded = body["prompt"]
    body["prompt"] = (
        decoded.tolist() if isinstance(decoded, memoryview) else [ids.tolist() for ids in decoded]
    )
    assert body == expected


def test_chat_prompt_is_the_text_of_every_message() -> None:
    raw = json.dumps(
        {
            "model": "m",
            "stream": True,
            "messages": [
                {"role": "system", "content": "abcd"},
                {"role": "user", "content": [{"type": "text", "text": "efgh"}, {"type": "image_url"}]},
                {"role": "assistant", "content": None},
            ],
        }
    ).encode()
    body, parsed = parse(Kind.CHAT, raw)
    assert parsed.stream and parsed.model == "m" and parsed.texts == ("abcdefgh",) and parsed.batch is None
    assert body["messages"][0]["role"] == "system"
    (key,) = prompt_keys(parsed, block_size_tokens=1, chars_per_token=4.0)
    assert key.tokens == 2 and len(key.block_hashes) == 2


@pytest.mark.parametrize(
    ("kind", "body", "prompts", "batch"),
    [
        (Kind.GENERATE, {"text": "a"}, 1, None),
        (Kind.GENERATE, {"text": ["a", "b", "c"]}, 3, 3),
        (Kind.GENERATE, {"input_ids": [1, 2]}, 1, None),
        (Kind.GENERATE, {"input_ids": [[1], [2, 3]]}, 2, 2),
        (Kind.COMPLETION, {"prompt": ["a", "b"]}, 2, 2),
        (Kind.COMPLETION, {"prompt": [5, 6, 7]}, 1, None),
        (Kind.COMPLETION, {"prompt": "a", "n": 3}, 3, None),
        (Kind.COMPLETION, {"prompt": ["a", "b"], "n": 2}, 4, 2),
        (Kind.GENERATE, {"text": ["a", "b"], "sampling_params": {"n": 3}}, 6, 2),
    ],
)
def test_batches_and_n_make_one_item_per_generation(
    kind: Kind, body: dict[str, object], prompts: int, batch: int | None
) -> None:
    _, parsed = parse(kind, json.dumps(body).encode())
    assert parsed.batch == batch
    assert len(prompt_keys(parsed, 4, 4.0)) == prompts


def test_bootstrap_fields_are_spliced_in_and_override_the_clients() -> None:
    raw = b'{"text": "hi", "bootstrap_room": 5, "stream": true}\n'
    body, parsed = parse(Kind.GENERATE, raw)
    out = json.loads(with_bootstrap(raw, body, parsed, "127.0.1.1", 8998, [42]))
    assert out == {
        "text": "hi",
        "stream": True,
        "bootstrap_host": "127.0.1.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 42,
    }


@pytest.mark.parametrize(
    ("kind", "raw"),
    [
        (Kind.GENERATE, b'{"text": "hi", "cache_salt": "theirs"}'),
        (
            Kind.GENERATE,
            b'{"text": "hi", "cache_salt": "theirs", "cache\\u005fsalt": "theirs"}',
        ),  # one key, escaped
        (Kind.GENERATE, b'{"text": ["a", "b"], "cache_salt": ["theirs", "theirs"]}'),
        (Kind.GENERATE, b'{"text": "a", "sampling_params": {"n": 2}, "cache_salt": "theirs"}'),
        (Kind.COMPLETION, b'{"prompt": "hi"}'),
        (Kind.CHAT, b'{"messages": [{"role": "user", "content": "x"}], "cache_salt": "theirs"}'),
    ],
)
def test_the_consumers_salt_replaces_any_salt_a_client_sent(kind: Kind, raw: bytes) -> None:
    """The engines see the consumer's salt alone: no client salt beside it for a JSON parser that
    kept the first duplicate key, and one string for a batch (SGLang gives it to every prompt)."""
    body, parsed = parse(kind, raw)
    out = with_bootstrap(raw, body, parsed, "h", 1, list(range(parsed.samples)), "mine")
    assert json.loads(out)["cache_salt"] == "mine"
    assert b"theirs" not in out and out.count(b"salt") == 1


def test_without_a_consumer_salt_the_clients_goes_to_the_engines_as_sent() -> None:
    raw = b'{"text": "hi", "cache_salt": "theirs"}'
    body, parsed = parse(Kind.GENERATE, raw)
    assert json.loads(with_bootstrap(raw, body, parsed, "h", 1, [2]))["cache_salt"] == "theirs"


def test_prompt_keys_are_in_the_salts_namespace() -> None:
    _, parsed = parse(Kind.GENERATE, b'{"text": "a long enough prompt"}')
    hashes = {salt: prompt_keys(parsed, 2, 1.0, salt)[0].block_hashes for salt in (None, "a", "b")}
    assert len(set(hashes.values())) == 3
    assert hashes["a"] == prompt_keys(parsed, 2, 1.0, "a")[0].block_hashes


def test_a_batch_gets_arrays_of_bootstrap_fields() -> None:
    raw = b'{"text": ["a", "b"]}'
    body, parsed = parse(Kind.GENERATE, raw)
    out = json.loads(with_bootstrap(raw, body, parsed, "h", 1, [7, 8]))
    assert out["bootstrap_host"] == ["h", "h"] and out["bootstrap_port"] == [1, 1]
    assert out["bootstrap_room"] == [7, 8]


@pytest.mark.parametrize(
    ("kind", "body", "field", "expected"),
    [
        (Kind.COMPLETION, {"prompt": "a", "n": 2}, "prompt", ["a", "a"]),
        (Kind.COMPLETION, {"prompt": ["a", "b"], "n": 2}, "prompt", ["a", "a", "b", "b"]),
        (Kind.COMPLETION, {"prompt": [5, 6], "n": 3}, "prompt", [[5, 6]] * 3),
        (Kind.GENERATE, {"text": "a", "sampling_params": {"n": 2, "max_new_tokens": 4}}, "text", ["a", "a"]),
        (Kind.GENERATE, {"input_ids": [[1], [2, 3]], "sampling_params": {"n": 2}}, "input_ids", [[1], [1], [2, 3], [2, 3]]),
    ],
)  # fmt: skip
def test_n_above_one_goes_out_as_a_batch_of_single_samples_with_a_room_each(
    kind: Kind, body: dict[str, Any], field: str, expected: list[object]
) -> None:
    """SGLang 0.5.23 pairs every sample of a prompt on one room (they collide): one room per sample
    needs a batch of n = 1 samples, prompt by prompt as SGLang orders its samples."""
    raw = json.dumps(body).encode()
    _, parsed = parse(kind, raw)
    rooms = list(range(100, 100 + parsed.samples))
    out = json.loads(with_bootstrap(raw, json.loads(raw), parsed, "h", 9, rooms))
    assert out[field] == expected and len(expected) == parsed.samples
    n = out["sampling_params"]["n"] if kind is Kind.GENERATE else out["n"]
    assert n == 1
    assert out["bootstrap_room"] == rooms and out["bootstrap_host"] == ["h"] * parsed.samples
    assert out["bootstrap_port"] == [9] * parsed.samples
    if kind is Kind.GENERATE:
        assert {k: v for k, v in out["sampling_params"].items() if k != "n"} == {
            k: v for k, v in body["sampling_params"].items() if k != "n"
        }


def test_a_rid_list_gets_one_rid_per_sample() -> None:
    raw = json.dumps({"text": ["a", "b"], "rid": ["x", "y"], "sampling_params": {"n": 2}}).encode()
    body, parsed = parse(Kind.GENERATE, raw)
    out = json.loads(with_bootstrap(raw, body, parsed, "h", 9, [1, 2, 3, 4]))
    assert out["rid"] == ["x_0", "x_1", "y_0", "y_1"]


def test_chat_with_n_above_one_is_refused_with_the_reason() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode()
    with pytest.raises(ApiError) as caught:
        parse(Kind.CHAT, raw)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "n", "unsupported_value")
    assert "bootstrap room" in caught.value.message
    assert parse(Kind.CHAT, raw.replace(b'"n": 2', b'"n": 1'))[1].samples == 1


def test_a_body_that_is_not_plain_utf8_json_is_re_encoded() -> None:
    raw = '{"text": "hé"}'.encode("utf-16")
    body, parsed = parse(Kind.GENERATE, raw)
    out = json.loads(with_bootstrap(raw, body, parsed, "h", 2, [3]))
    assert out == {"text": "hé", "bootstrap_host": "h", "bootstrap_port": 2, "bootstrap_room": 3}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8-sig"])
def test_a_re_encoded_body_carries_its_token_ids_as_arrays(encoding: str) -> None:
    for ids, rooms in (([1, 2**64 - 1], [3]), ([[1, 2**64 - 1], [5]], [3, 4])):
        raw = json.dumps({"input_ids": ids, "stream": False}).encode(encoding)
        body, parsed = parse(Kind.GENERATE, raw)
        out = json.loads(with_bootstrap(raw, body, parsed, "h", 2, rooms))
        assert out["input_ids"] == ids and out["bootstrap_room"] == (rooms if parsed.batch else rooms[0])


@given(
    st.dictionaries(
        st.text(max_size=5).filter(
            lambda k: (
                not k.startswith("bootstrap")
                and k not in ("text", "input_ids", "sampling_params", "stream", "model")
            )
        ),  # what parse reads of a /generate body is the prompt's and checked: the rest is spliced as is
        st.one_of(st.integers(), st.text(max_size=5), st.none()),
        max_size=4,
    ),
    st.integers(0, 2**63 - 1),
)
def test_splicing_equals_merging(extra: dict[str, object], room: int) -> None:
    body = {"text": "x", **extra}
    raw = json.dumps(body).encode()
    _, parsed = parse(Kind.GENERATE, raw)
    spliced = json.loads(with_bootstrap(raw, body, parsed, "10.0.0.1", 8998, [room]))
    assert spliced == {**body, "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": room}


def test_output_tokens_are_read_from_usage_or_meta_info() -> None:
    assert completion_tokens(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 12}}') == 12
    assert (
        completion_tokens(
            b'[{"meta_info": {"completion_tokens": 3}}, {"meta_info": {"completion_tokens": 4}}]'
        )
        == 7
    )
    assert completion_tokens(b'{"text": "no usage"}') is None
    assert (
        last_completion_tokens(b'data: {"completion_tokens": 1}\n\ndata: {"completion_tokens": 2}\n\n') == 2
    )


LIMITS = Limits(max_n=8, max_batch=16, context_tokens=1000)


@pytest.mark.parametrize(
    ("kind", "body", "param", "code"),
    [
        (Kind.CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 9}, "n", "invalid_value"),
        (Kind.CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 2_000_000}, "n", "invalid_value"),
        (Kind.COMPLETION, {"prompt": ["a"] * 17}, "prompt", "batch_too_large"),
        (Kind.COMPLETION, {"prompt": ["a"] * 3, "n": 6}, "n", "batch_too_large"),
        (Kind.COMPLETION, {"prompt": [[1]] * 17}, "prompt", "batch_too_large"),
        (Kind.GENERATE, {"input_ids": [[1, 2]] * 17}, "input_ids", "batch_too_large"),
        (Kind.GENERATE, {"text": ["a"] * 17}, "text", "batch_too_large"),
        (Kind.GENERATE, {"text": "a", "sampling_params": {"n": 9}}, "sampling_params.n", "invalid_value"),
        (
            Kind.CHAT,
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1001},
            "max_tokens",
            "context_length_exceeded",
        ),
        (
            Kind.COMPLETION,
            {"prompt": "a", "max_completion_tokens": 10**30},
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        (
            Kind.COMPLETION,
            {"prompt": list(range(900)), "max_tokens": 101},
            "max_tokens",
            "context_length_exceeded",
        ),
        (
            Kind.GENERATE,
            {"input_ids": list(range(999)), "sampling_params": {"max_new_tokens": 2}},
            "sampling_params.max_new_tokens",
            "context_length_exceeded",
        ),
        (
            Kind.GENERATE,
            {"text": "a", "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
            "invalid_value",
        ),
    ],
)
def test_what_a_client_may_ask_for_is_bounded_naming_the_field(
    kind: Kind, body: dict[str, object], param: str, code: str
) -> None:
    with pytest.raises(ApiError) as caught:
        parse(kind, json.dumps(body).encode(), LIMITS)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)


def test_requests_at_the_bounds_pass() -> None:
    _, parsed = parse(Kind.COMPLETION, json.dumps({"prompt": ["a", "b"], "n": 8}).encode(), LIMITS)
    assert (parsed.batch, parsed.copies) == (2, 8)
    ids = {"input_ids": list(range(998)), "sampling_params": {"max_new_tokens": 2}}
    _, parsed = parse(Kind.GENERATE, json.dumps(ids).encode(), LIMITS)
    assert len(parsed.token_ids[0]) == 998
    # a text prompt's length is only estimated: only the output is held against the context
    text = {"prompt": "x" * 100_000, "max_tokens": 1000}
    assert parse(Kind.COMPLETION, json.dumps(text).encode(), LIMITS)[1].texts


def test_a_huge_n_is_refused_in_microseconds() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 2_000_000}).encode()
    started = time.perf_counter()
    for _ in range(100):
        with pytest.raises(ApiError):
            parse(Kind.CHAT, raw)
    assert (time.perf_counter() - started) / 100 < 0.001


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ("req-42", True),
        ("a" * 128, True),
        ("a" * 129, False),
        ("é€", False),
        ("Ã©â\x82¬", False),  # raw UTF-8 read as Latin-1, as aiohttp hands it over
        ("tab\there", False),
        ("", False),
        (None, False),
    ],
)
def test_request_ids_are_kept_only_when_short_printable_ascii(sent: str | None, kept: bool) -> None:
    rid = request_id(sent)
    assert (rid == sent) is kept
    assert rid.isascii() and rid.isprintable() and len(rid) <= 128
    if not kept:
        assert len(rid) == 32


@pytest.mark.parametrize(
    ("status", "body", "content_type", "message", "param", "code"),
    [
        (
            400,
            b'{"object": "error", "message": "too long", "type": "BadRequestError", "param": "max_tokens", "code": 400}',
            "application/json",
            "too long",
            "max_tokens",
            "engine_bad_request",
        ),
        (
            400,
            b'{"error": {"message": "bad ids", "code": 400}}',
            "application/json",
            "bad ids",
            None,
            "engine_bad_request",
        ),
        (
            413,
            b"Request Entity Too Large",
            "text/plain",
            "Request Entity Too Large",
            None,
            "engine_payload_too_large",
        ),
        (
            422,
            b'{"detail": [{"loc": ["body"], "msg": "x"}]}',
            "application/json",
            '{"detail"',
            None,
            "engine_invalid_request",
        ),
        (
            409,
            b'{"error": {"message": "taken", "code": "room_in_use"}}',
            "application/json",
            "taken",
            None,
            "room_in_use",
        ),
        (418, b"", "text/plain", "HTTP 418", None, "engine_http_418"),
    ],
)
def test_engine_errors_are_mapped_into_the_routers_shape(
    status: int, body: bytes, content_type: str, message: str, param: str | None, code: str
) -> None:
    error = engine_error(status, body, content_type)
    assert error.status == status and message in error.message
    assert (error.param, error.code, error.type) == (param, code, "invalid_request_error")
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
