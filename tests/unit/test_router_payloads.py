"""Request validation, prompt extraction and the PD bootstrap fields."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prfaas_router.payloads import (
    ApiError,
    Kind,
    completion_tokens,
    last_completion_tokens,
    parse,
    prompt_keys,
    unhashable_token_ids,
    with_bootstrap,
)
from prfaas_router.prefix_index import PrefixIndex


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


def test_unhashable_token_ids_fail_where_they_are_hashed_and_are_a_400() -> None:
    _, parsed = parse(Kind.GENERATE, b'{"input_ids": [1, [2], 3]}')
    (key,) = prompt_keys(parsed, 4, 4.0)  # keys hash lazily: nothing is hashed yet
    with pytest.raises(TypeError):
        PrefixIndex(8, 8).lookup(key)
    error = unhashable_token_ids()
    assert (error.status, error.param, error.code) == (400, "input_ids", "invalid_type")
    assert "integers" in error.message


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
        (Kind.COMPLETION, {"prompt": "a", "n": 3}, 3, 3),
        (Kind.COMPLETION, {"prompt": ["a", "b"], "n": 2}, 4, 4),
        (Kind.CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 2}, 2, 2),
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
    out = json.loads(with_bootstrap(raw, body, "127.0.1.1", 8998, [42], parsed.batch))
    assert out == {
        "text": "hi",
        "stream": True,
        "bootstrap_host": "127.0.1.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 42,
    }


def test_a_batch_gets_arrays_of_bootstrap_fields() -> None:
    raw = b'{"text": ["a", "b"]}'
    body, parsed = parse(Kind.GENERATE, raw)
    out = json.loads(with_bootstrap(raw, body, "h", 1, [7, 8], parsed.batch))
    assert out["bootstrap_host"] == ["h", "h"] and out["bootstrap_port"] == [1, 1]
    assert out["bootstrap_room"] == [7, 8]


def test_a_body_that_is_not_plain_utf8_json_is_re_encoded() -> None:
    raw = '{"text": "hé"}'.encode("utf-16")
    body, parsed = parse(Kind.GENERATE, raw)
    out = json.loads(with_bootstrap(raw, body, "h", 2, [3], parsed.batch))
    assert out == {"text": "hé", "bootstrap_host": "h", "bootstrap_port": 2, "bootstrap_room": 3}


@given(
    st.dictionaries(
        st.text(max_size=5).filter(lambda k: not k.startswith("bootstrap")),
        st.one_of(st.integers(), st.text(max_size=5), st.none()),
        max_size=4,
    ),
    st.integers(0, 2**63 - 1),
)
def test_splicing_equals_merging(extra: dict[str, object], room: int) -> None:
    body = {"text": "x", **extra}
    raw = json.dumps(body).encode()
    spliced = json.loads(with_bootstrap(raw, body, "10.0.0.1", 8998, [room], None))
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
