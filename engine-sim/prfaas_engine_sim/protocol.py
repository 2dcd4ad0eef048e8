"""Request parsing and response shapes of the fake engine: SGLang's /generate and the OpenAI API.

Pure: bodies in, dataclasses and JSON-ready dicts out. The engine never sees a model, so
prompts are counted with the calibrated estimate (input_ids: their number; text:
ceil(characters / chars_per_token); chat: the concatenated text of every message's content)
and the output is a deterministic word sequence, one word of four characters per token.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any

from prfaas_engine_sim.timing import text_tokens

FAKE_BOOTSTRAP_HOST = "2.2.2.2"
"""SGLang's health checks send this host: both legs then run without a KV transfer."""

MAX_ROOM = 2**63 - 1

_VOCAB = (" the", " and", " for", " you", " are", " was", " not", " all")
_VOCAB_JSON = tuple(json.dumps(word).encode() for word in _VOCAB)
_VOCAB_FIRST_ID = 1000


def token_text(position: int) -> str:
    return _VOCAB[position % len(_VOCAB)]


def token_id(position: int) -> int:
    return _VOCAB_FIRST_ID + position % len(_VOCAB)


def output_text(count: int) -> str:
    return "".join(token_text(i) for i in range(count))


class Api(enum.StrEnum):
    GENERATE = "generate"
    COMPLETIONS = "completions"
    CHAT = "chat"


class RequestError(Exception):
    """A request the engine refuses; the message names the cause and goes back to the client."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class BootstrapTarget:
    """Where the decode leg fetches the KV of one item: the prefill's bootstrap server and room."""

    host: str
    port: int | None
    room: int

    @property
    def is_fake(self) -> bool:
        return self.host == FAKE_BOOTSTRAP_HOST


@dataclass(frozen=True)
class Prompt:
    tokens: int
    token_ids: Sequence[int] | None
    text: str | None
    cache_salt: str | None = None
    """The prefix cache namespace it is computed and looked up in (None: the shared one)."""


@dataclass(frozen=True)
class Item:
    """One generation: a prompt, its output budget, and its PD bootstrap target if any."""

    prompt: Prompt
    max_new_tokens: int
    bootstrap: BootstrapTarget | None
    index: int
    prompt_index: int


@dataclass(frozen=True)
class ParsedRequest:
    api: Api
    items: list[Item]
    """What the client gets back: n copies of every prompt, prompt after prompt."""
    warmups: list[Item]
    """With n > 1, one per prompt, run (one after the other) before the copies start and never
    answered: SGLang's tokenizer_manager.py ``_handle_batch_request`` first sends each prompt
    with ``max_new_tokens=0`` to cache its prefix, then the n copies, every one with the
    prompt's room, so in PD each is a KV transfer of its own."""
    stream: bool
    batched: bool
    rid: str | None
    model: str | None
    include_usage: bool


@dataclass(frozen=True)
class ParseOptions:
    chars_per_token: float
    default_max_new_tokens: int
    context_length: int
    required_bootstrap_mode: str | None
    """``prefill``/``decode`` when bootstrap fields are mandatory (PD mode); None ignores them."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise RequestError(f"{what} must be a list of non-negative integer token ids")
    return value


def _non_negative_int(value: Any, what: str) -> int:
    if not _is_int(value) or value < 0:
        raise RequestError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def _positive_int(value: Any, what: str) -> int:
    if not _is_int(value) or value < 1:
        raise RequestError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{what} must be a boolean, got {value!r}")
    return value


def _text_prompt(text: Any, what: str, options: ParseOptions) -> Prompt:
    if not isinstance(text, str):
        raise RequestError(f"{what} must be a string, got {type(text).__name__}")
    if not text:
        raise RequestError(f"{what} is empty")
    return Prompt(tokens=text_tokens(text, options.chars_per_token), token_ids=None, text=text)


def _ids_prompt(ids: Any, what: str) -> Prompt:
    token_ids = _token_ids(ids, what)
    if not token_ids:
        raise RequestError(f"{what} is empty")
    return Prompt(tokens=len(token_ids), token_ids=token_ids, text=None)


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    """A list of ``count`` values, or one value for every item."""
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} values for a batch of {count}")
        return value
    return [value] * count


def _prompt_rooms(room: Any, count: int) -> list[Any]:
    """The room of each prompt as SGLang assigns it (io_struct.py
    ``GenerateReqInput._normalize_bootstrap_params``): a list gives prompt i its i-th room
    (repeated n times, so every copy of prompt i has room i), a number gives it room + i."""
    if isinstance(room, list):
        if len(room) < count:
            raise RequestError(f"bootstrap_room has {len(room)} values for {count} prompts")
        return room[:count]
    if _is_int(room):
        return [room + i for i in range(count)]
    return [room] * count


def _cache_salts(value: Any, count: int) -> list[str | None]:
    """Each prompt's ``cache_salt`` as SGLang normalizes it (io_struct.py ``_normalize_cache_salt``):
    one string for every prompt, or one per prompt; an empty one is none."""
    if value is None:
        return [None] * count
    salts = _per_item(value, count, "cache_salt")
    if not all(isinstance(salt, str) for salt in salts):
        raise RequestError("Every cache_salt should be a string.")
    return [salt or None for salt in salts]


def _bootstrap_targets(
    body: dict[str, Any], count: int, options: ParseOptions
) -> list[BootstrapTarget | None]:
    """One target per prompt (every copy of a prompt goes to its prompt's room)."""
    mode = options.required_bootstrap_mode
    if mode is None:
        return [None] * count
    rooms = _prompt_rooms(body.get("bootstrap_room"), count)
    hosts = _per_item(body.get("bootstrap_host"), count, "bootstrap_host")
    ports = _per_item(body.get("bootstrap_port"), count, "bootstrap_port")
    targets: list[BootstrapTarget | None] = []
    for room, host, port in zip(rooms, hosts, ports, strict=True):
        if room is None:
            raise RequestError(f"bootstrap_room is required in {mode.upper()} mode")
        if host is None:
            raise RequestError(f"bootstrap_host is required in {mode.upper()} mode")
        if not _is_int(room) or not 0 <= room <= MAX_ROOM:
            raise RequestError(f"bootstrap_room must be an integer in [0, 2^63-1], got {room!r}")
        if not isinstance(host, str) or not host:
            raise RequestError(f"bootstrap_host must be a non-empty string, got {host!r}")
        if port is not None and (not _is_int(port) or not 1 <= port <= 65535):
            raise RequestError(f"bootstrap_port must be null or a port number, got {port!r}")
        targets.append(BootstrapTarget(host=host, port=port, room=room))
    return targets


def _items(
    body: dict[str, Any], prompts: list[Prompt], max_new: list[int], n: int, options: ParseOptions
) -> tuple[list[Item], list[Item]]:
    """The copies and the warm-ups (see ParsedRequest)."""
    targets = _bootstrap_targets(body, len(prompts), options)
    salts = _cache_salts(body.get("cache_salt"), len(prompts))
    prompts = [replace(prompt, cache_salt=salt) for prompt, salt in zip(prompts, salts, strict=True)]
    items = []
    for index in range(len(prompts) * n):
        prompt_index = index // n
        prompt, budget = prompts[prompt_index], max_new[prompt_index]
        if prompt.tokens + budget > options.context_length:
            raise RequestError(
                f"The input ({prompt.tokens} tokens) plus max_new_tokens ({budget}) is longer than the "
                f"model's context length ({options.context_length} tokens)."
            )
        items.append(
            Item(
                prompt=prompt,
                max_new_tokens=budget,
                bootstrap=targets[prompt_index],
                index=index,
                prompt_index=prompt_index,
            )
        )
    warmups = [
        Item(prompt=prompt, max_new_tokens=0, bootstrap=target, index=i, prompt_index=i)
        for i, (prompt, target) in enumerate(zip(prompts, targets, strict=True))
        if n > 1
    ]
    return items, warmups


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _rid(body: dict[str, Any]) -> str | None:
    rid = body.get("rid")
    if rid is None:
        return None
    if isinstance(rid, str) and rid:
        return rid
    if isinstance(rid, list) and rid and all(isinstance(r, str) and r for r in rid):
        return str(rid[0])
    raise RequestError("rid must be a non-empty string (or a list of them for a batch)")


def parse_generate(raw: Any, options: ParseOptions) -> ParsedRequest:
    """SGLang's native /generate: text or input_ids, single or batched, sampling_params.max_new_tokens."""
    body = _object(raw)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("Either text or input_ids should be provided (exactly one of them).")
    batched = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        if not texts:
            raise RequestError("text is an empty batch")
        prompts = [_text_prompt(t, f"text[{i}]" if batched else "text", options) for i, t in enumerate(texts)]
    else:
        batch: list[Any] = ids if batched and isinstance(ids, list) else [ids]
        prompts = [_ids_prompt(b, f"input_ids[{i}]" if batched else "input_ids") for i, b in enumerate(batch)]
    params = body.get("sampling_params")
    param_list = _per_item(params, len(prompts), "sampling_params")
    max_new = []
    copies = set()
    for param in param_list:
        if param is not None and not isinstance(param, dict):
            raise RequestError("sampling_params must be an object")
        value = (param or {}).get("max_new_tokens")
        max_new.append(
            options.default_max_new_tokens if value is None else _non_negative_int(value, "max_new_tokens")
        )
        copies.add(_positive_int((param or {}).get("n", 1), "sampling_params.n"))
    if len(copies) > 1:  # io_struct.py _handle_parallel_sampling
        raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
    n = copies.pop()
    items, warmups = _items(body, prompts, max_new, n, options)
    return ParsedRequest(
        api=Api.GENERATE,
        items=items,
        warmups=warmups,
        stream=_bool(body.get("stream", False), "stream"),
        batched=batched or n > 1,  # n > 1 makes a single prompt a batch (_handle_parallel_sampling)
        rid=_rid(body),
        model=None,
        include_usage=False,
    )


def _openai_common(body: dict[str, Any], options: ParseOptions) -> tuple[int, int, bool, bool, str | None]:
    """max_tokens, n, stream, include_usage and model of an OpenAI request."""
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = options.default_max_new_tokens if value is None else _non_negative_int(value, "max_tokens")
    n = _positive_int(body.get("n", 1), "n")
    stream = _bool(body.get("stream", False), "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object")
    include_usage = _bool(stream_options.get("include_usage", False), "stream_options.include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string")
    return max_tokens, n, stream, include_usage, model


def parse_completions(raw: Any, options: ParseOptions) -> ParsedRequest:
    """OpenAI /v1/completions: prompt is a string, a list of strings, token ids or lists of them."""
    body = _object(raw)
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("prompt is required")
    if isinstance(prompt, str):
        prompts = [_text_prompt(prompt, "prompt", options)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [_text_prompt(p, f"prompt[{i}]", options) for i, p in enumerate(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_ids_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    elif isinstance(prompt, list) and prompt:
        prompts = [_ids_prompt(prompt, "prompt")]
    else:
        raise RequestError("prompt must be a non-empty string, list of strings, or token ids")
    max_tokens, n, stream, include_usage, model = _openai_common(body, options)
    items, warmups = _items(body, prompts, [max_tokens] * len(prompts), n, options)
    return ParsedRequest(
        api=Api.COMPLETIONS,
        items=items,
        warmups=warmups,
        stream=stream,
        batched=len(prompts) * n > 1,
        rid=_rid(body),
        model=model,
        include_usage=include_usage,
    )


def _message_text(message: Any, index: int) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{index}] must be an object with a string role")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(f"messages[{index}].content parts must be objects with a type")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{index}].content text part needs a string text")
                parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{index}].content must be a string, a list of parts or null")


def parse_chat(raw: Any, options: ParseOptions) -> ParsedRequest:
    """OpenAI /v1/chat/completions; the prompt is the concatenated text of every message."""
    body = _object(raw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    text = "".join(_message_text(message, i) for i, message in enumerate(messages))
    prompt = _text_prompt(text, "the messages' content", options)
    max_tokens, n, stream, include_usage, model = _openai_common(body, options)
    items, warmups = _items(body, [prompt], [max_tokens], n, options)
    return ParsedRequest(
        api=Api.CHAT,
        items=items,
        warmups=warmups,
        stream=stream,
        batched=n > 1,
        rid=_rid(body),
        model=model,
        include_usage=include_usage,
    )


# ----------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class ItemResult:
    """How one item finished: token counts and SGLang's finish reason."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    e2e_latency: float
    abort_message: str | None = None

    @property
    def finish_reason(self) -> str:
        return "abort" if self.abort_message is not None else "length"

    def sglang_finish_reason(self) -> dict[str, Any]:
        if self.abort_message is not None:
            return {"type": "abort", "message": self.abort_message}
        return {"type": "length", "length": self.completion_tokens}


def usage(items: Sequence[Item], results: Sequence[ItemResult]) -> dict[str, Any]:
    """OpenAI usage; a prompt shared by n choices counts once."""
    seen: set[int] = set()
    prompt_tokens = cached = completion = 0
    for item, result in zip(items, results, strict=True):
        completion += result.completion_tokens
        if item.prompt_index not in seen:
            seen.add(item.prompt_index)
            prompt_tokens += result.prompt_tokens
            cached += result.cached_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def generate_meta(
    rid: str, prompt_tokens: int, cached_tokens: int, produced: int, result: ItemResult | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": result.sglang_finish_reason() if result else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": produced,
        "cached_tokens": cached_tokens,
    }
    if result is not None:
        meta["e2e_latency"] = result.e2e_latency
    return meta


def generate_body(rid: str, result: ItemResult) -> dict[str, Any]:
    count = result.completion_tokens
    return {
        "text": output_text(count),
        "output_ids": [token_id(i) for i in range(count)],
        "meta_info": generate_meta(rid, result.prompt_tokens, result.cached_tokens, count, result),
    }


def completion_body(
    rid: str, model: str, created: int, items: Sequence[Item], results: Sequence[ItemResult]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": item.index,
                "text": output_text(result.completion_tokens),
                "logprobs": None,
                "finish_reason": result.finish_reason,
                "matched_stop": None,
            }
            for item, result in zip(items, results, strict=True)
        ],
        "usage": usage(items, results),
    }


def chat_body(
    rid: str, model: str, created: int, items: Sequence[Item], results: Sequence[ItemResult]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": item.index,
                "message": {"role": "assistant", "content": output_text(result.completion_tokens)},
                "logprobs": None,
                "finish_reason": result.finish_reason,
                "matched_stop": None,
            }
            for item, result in zip(items, results, strict=True)
        ],
        "usage": usage(items, results),
    }


def completion_chunk(
    rid: str, model: str, created: int, index: int, text: str, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_chunk(
    rid: str, model: str, created: int, index: int, delta: dict[str, Any], finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


_JSON_SEPARATORS = (",", ":")
_SLOT = "\u0000slot\u0000"
SSE_DONE = b"data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=_JSON_SEPARATORS).encode() + b"\n\n"


class StreamFormatter:
    """The SSE events of one streamed request, in the shape of its API.

    Token chunks of the OpenAI APIs differ only in their text, so each is a precomputed JSON
    template around the JSON-encoded word: a stream costs no json.dumps per token.
    """

    def __init__(self, api: Api, rid: str, model: str, created: int, batched: bool) -> None:
        self.api, self.rid, self.model, self.created, self.batched = api, rid, model, created, batched
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    def _template(self, index: int) -> tuple[bytes, bytes]:
        template = self._templates.get(index)
        if template is None:
            if self.api is Api.CHAT:
                body = chat_chunk(self.rid, self.model, self.created, index, {"content": _SLOT}, None)
            else:
                body = completion_chunk(self.rid, self.model, self.created, index, _SLOT, None)
            head, _, tail = json.dumps(body, separators=_JSON_SEPARATORS).partition(json.dumps(_SLOT))
            template = self._templates[index] = (b"data: " + head.encode(), tail.encode() + b"\n\n")
        return template

    def opening(self, index: int) -> bytes:
        """OpenAI chat streams open each choice with the assistant role, with its first token
        (serving_chat.py ``_generate_chat_stream``: the role chunk is yielded for the first
        output the engine produced, never before)."""
        if self.api is not Api.CHAT:
            return b""
        return sse(
            chat_chunk(self.rid, self.model, self.created, index, {"role": "assistant", "content": ""}, None)
        )

    def token(self, item_rid: str, index: int, position: int, prompt_tokens: int, cached: int) -> bytes:
        if self.api is not Api.GENERATE:
            head, tail = self._template(index)
            return head + _VOCAB_JSON[position % len(_VOCAB)] + tail
        # SGLang's /generate streams the cumulative text by default
        chunk: dict[str, Any] = {
            "text": output_text(position + 1),
            "output_ids": [token_id(position)],
            "meta_info": generate_meta(item_rid, prompt_tokens, cached, position + 1, None),
        }
        if self.batched:
            chunk["index"] = index
        return sse(chunk)

    def finish(self, item_rid: str, index: int, result: ItemResult) -> bytes:
        if self.api is Api.CHAT:
            return sse(chat_chunk(self.rid, self.model, self.created, index, {}, result.finish_reason))
        if self.api is Api.COMPLETIONS:
            return sse(completion_chunk(self.rid, self.model, self.created, index, "", result.finish_reason))
        count = result.completion_tokens
        chunk: dict[str, Any] = {
            "text": output_text(count),
            "output_ids": [],
            "meta_info": generate_meta(item_rid, result.prompt_tokens, result.cached_tokens, count, result),
        }
        if self.batched:
            chunk["index"] = index
        return sse(chunk)

    def usage(self, usage_body: dict[str, Any]) -> bytes:
        kind = "chat.completion.chunk" if self.api is Api.CHAT else "text_completion"
        return sse(
            {
                "id": self.rid,
                "object": kind,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage_body,
            }
        )

    def abort(
        self,
        item_rid: str,
        index: int,
        message: str,
        status: int,
        prompt_tokens: int,
        cached: int,
        produced: int,
    ) -> bytes:
        """The event of a request the engine aborted with a status (a failed KV handoff) after the
        stream began: HTTP stays 200 and the error is an SSE event, then ``[DONE]``.

        OpenAI routes: ``{"error": ErrorResponse}`` with the status's name as its type
        (serving_chat.py ``_generate_chat_stream`` and serving_completions.py, the abort branch,
        ``create_streaming_error_response(message, code.name, code.value)``). /generate: the
        aborted output itself, its finish_reason carrying the status (http_server.py
        ``stream_results`` dumps what tokenizer_manager.py ``_handle_abort_finish_reason`` yields).
        """
        if self.api is not Api.GENERATE:
            error = {"object": "error", "message": message, "type": HTTPStatus(status).name, "param": None}
            return sse({"error": error | {"code": status}})
        meta = generate_meta(item_rid, prompt_tokens, cached, produced, None)
        meta["finish_reason"] = abort_finish_reason(message, status)
        chunk: dict[str, Any] = {"text": output_text(produced), "output_ids": [], "meta_info": meta}
        if self.batched:
            chunk["index"] = index
        return sse(chunk)


def abort_finish_reason(message: str, status: int) -> dict[str, Any]:
    """schedule_batch.py ``FINISH_ABORT.to_json`` of an abort with a status code."""
    return {"type": "abort", "message": message, "status_code": status, "err_type": None}


def request_error_body(api: Api, message: str) -> dict[str, Any]:
    """A request refused before it ran (400): /generate's ``{"error": {"message"}}``
    (http_server.py ``_create_error_response``), the OpenAI routes' ErrorResponse
    (serving_base.py ``create_error_response``, type BadRequestError)."""
    if api is Api.GENERATE:
        return {"error": {"message": message}}
    return error_response(message, "BadRequestError", 400)


def abort_error_body(api: Api, message: str, status: int) -> dict[str, Any]:
    """A non-streamed request the engine aborted with a status: tokenizer_manager.py
    ``_handle_abort_finish_reason`` raises ValueError for 400 and HTTPException otherwise.
    /generate answers a ValueError as ``_create_error_response`` does and an HTTPException through
    http_server.py's handler (ErrorResponse, type ``str(status)``); the OpenAI routes through
    serving_base.py ``handle_request`` (type ``BadRequest`` for 400, else ``str(status)``)."""
    if status == 400:
        return (
            request_error_body(api, message)
            if api is Api.GENERATE
            else error_response(message, "BadRequest", 400)
        )
    return error_response(message, str(status), status)


def error_response(message: str, type_: str, status: int) -> dict[str, Any]:
    """SGLang's ErrorResponse (openai/protocol.py)."""
    return {"object": "error", "message": message, "type": type_, "param": None, "code": status}
