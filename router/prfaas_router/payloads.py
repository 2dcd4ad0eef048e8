"""Request bodies in, PD bodies out: validation, prompt extraction, bootstrap fields (pure).

Only what routing needs is checked here (the prompt, `stream`, `model`, a few common sampling
fields) and what a client could use to make the router or an engine do unbounded work (`n`, batch
sizes, output lengths past the context: `Limits`, checked before any payload is built);
everything else is the engine's to validate, and its 4xx answers come back in the router's shape
(`engine_error`). Errors are OpenAI-style: {"error": {"message", "type", "param", "code"}}, the
code always a string.
"""

from __future__ import annotations

import enum
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import simdjson
from prfaas_core.routing.prefix_index import PromptKey, key_for_text, key_for_tokens, token_buffer


class Kind(enum.StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETION = "/v1/completions"
    GENERATE = "/generate"


class ApiError(Exception):
    """An answer the client gets instead of a completion; `code` is always a string, as OpenAI's."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one request may ask for (CLI flags; OpenAI allows n up to 128)."""

    max_n: int = 128
    max_batch: int = 1024  # generated items of one request: prompts x n
    context_tokens: int = 1_048_576  # no prompt plus output may be longer (the model's context length)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    stream: bool
    model: str | None
    texts: tuple[str, ...]  # prompts as text (empty when token ids are given)
    token_ids: tuple[memoryview, ...]  # prompts as token ids: uint64 buffers (format "Q"), as decoded
    copies: int  # n: each prompt is generated (and prefilled, and moved) n times
    batch: int | None
    """Prompts of a prompt field given as a list (None: one prompt)."""
    max_output_tokens: int
    """The most tokens one sample may generate: the request's limit, else the context length."""

    @property
    def samples(self) -> int:
        """Generated items, each paired on a bootstrap room of its own: prompts x n."""
        return (self.batch or 1) * self.copies


_OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens")
_NUMBER_FIELDS = ("temperature", "top_p")
_TOKEN_FIELDS = {Kind.COMPLETION: "prompt", Kind.GENERATE: "input_ids"}  # may hold token id arrays
_SALT = "cache_salt"
"""SGLang's cache namespace field (GenerateReqInput, CompletionRequest, ChatCompletionRequest)."""


def parse(kind: Kind, raw: bytes, limits: Limits = Limits()) -> tuple[dict[str, Any], ParsedRequest]:
    """Decode and check a request body; raises ApiError naming the offending field.

    The body comes back as plain Python values, except the token id arrays of the prompt field,
    which are uint64 buffers (`_decode`).
    """
    body = _decode(raw, _TOKEN_FIELDS.get(kind), limits.max_batch)
    if not isinstance(body, dict):
        raise ApiError(
            400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_type"
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _wrong_type("stream", "a boolean", stream)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    copies = 1
    if kind is Kind.GENERATE:
        texts, token_ids, batch = _generate_prompt(body)
        sampling = body.get("sampling_params") or {}
        copies = _check_count(sampling.get("n"), "sampling_params.n", limits.max_n)
        output = _check_output_length(sampling, "max_new_tokens", "sampling_params.", limits.context_tokens)
    else:
        copies = _check_sampling_fields(body, limits)
        output = max(
            (_check_output_length(body, field, "", limits.context_tokens) for field in _OUTPUT_FIELDS),
            key=lambda found: found[1],
        )
        if kind is Kind.CHAT:
            if copies > 1:
                raise ApiError(
                    400,
                    "'n' above 1 is not supported for chat completions with prefill-decode "
                    "disaggregation (SGLang 0.5.23 gives every sample one bootstrap room, and they "
                    "collide); send n requests, or use /v1/completions",
                    param="n",
                    code="unsupported_value",
                )
            texts, token_ids, batch = (_chat_text(body.get("messages")),), (), None
        else:
            texts, token_ids, batch = _completion_prompt(body.get("prompt"))
    items = (batch or 1) * copies
    if items > limits.max_batch:
        param = _PROMPT_FIELDS[kind] if copies == 1 else "sampling_params.n" if kind is Kind.GENERATE else "n"
        raise ApiError(
            400,
            f"the request asks for {items} generations; this router takes at most {limits.max_batch} per request",
            param=param,
            code="batch_too_large",
        )
    _check_context(token_ids, output, limits.context_tokens)
    max_output = output[1] if output[1] > 0 else limits.context_tokens
    return body, ParsedRequest(kind, bool(stream), model, texts, token_ids, copies, batch, max_output)


def request_id(sent: str | None) -> str:
    """The client's X-Request-Id when it is short printable ASCII (it goes into the engines'
    request lines and logs), else a new one."""
    if sent and len(sent) <= MAX_REQUEST_ID and sent.isascii() and sent.isprintable():
        return sent
    return os.urandom(16).hex()  # 32 hex digits like a uuid4, a sixth of its cost


MAX_REQUEST_ID = 128


def engine_error(status: int, body: bytes, content_type: str) -> ApiError:
    """An engine's error answer in the router's shape.

    SGLang answers OpenAI routes with {"object": "error", "message", "type", "param", "code": int},
    /generate with {"error": {"message", "code": int}}, and its HTTP server may answer in plain
    text (a 413); the message and a string param or code are kept, the rest is ours.
    """
    message: str | None = None
    param: str | None = None
    code: str | None = None
    if content_type == "application/json":
        try:
            document = json.loads(body)
        except ValueError:
            document = None
        if isinstance(document, dict) and isinstance(document.get("error"), dict):
            document = document["error"]
        if isinstance(document, dict):
            message = _string_or_none(document.get("message"))
            param = _string_or_none(document.get("param"))
            code = _string_or_none(document.get("code"))
    if message is None:
        message = body[:_ENGINE_MESSAGE_BYTES].decode("utf-8", "replace").strip() or f"HTTP {status}"
    return ApiError(
        status,
        f"the engine answered HTTP {status}: {message}",
        type_="invalid_request_error" if status < 500 else "upstream_error",
        param=param,
        code=code or _ENGINE_CODES.get(status, f"engine_http_{status}"),
    )


_ENGINE_MESSAGE_BYTES = 1000
_ENGINE_CODES = {
    400: "engine_bad_request",
    404: "engine_not_found",
    413: "engine_payload_too_large",
    422: "engine_invalid_request",
    429: "engine_overloaded",
}
_PROMPT_FIELDS = {Kind.CHAT: "messages", Kind.COMPLETION: "prompt", Kind.GENERATE: "text"}


def _string_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def prompt_keys(
    request: ParsedRequest, block_size_tokens: int, chars_per_token: float, salt: str | None = None
) -> list[PromptKey]:
    """One key per generated item: a prompt asked for n times is prefilled and shipped n times.
    `salt`: the cache namespace the engines get (`with_bootstrap`), which the index keys by too."""
    if not request.token_ids:
        keys = [key_for_text(text, block_size_tokens, chars_per_token, salt) for text in request.texts]
    else:
        keys = [key_for_tokens(ids, block_size_tokens, salt) for ids in request.token_ids]
    return keys * request.copies


def with_bootstrap(
    raw: bytes,
    body: dict[str, Any],
    request: ParsedRequest,
    host: str,
    port: int,
    rooms: Sequence[int],
    salt: str | None = None,
) -> bytes:
    """The body both PD legs get: SGLang's bootstrap fields, one room per sample (`samples`), and
    the consumer's `cache_salt` when it has one (RouterConfig.cache_salt), replacing the client's:
    a client naming another consumer's salt would read that consumer's cached prefixes.

    With n > 1 SGLang 0.5.23 pairs every sample of prompt i on one room: `_normalize_bootstrap_params`
    (io_struct.py) expands the rooms, but `_handle_batch_request` (tokenizer_manager.py) sends
    each copy of `obj[i]`, room i, after a `max_new_tokens=0` warm-up on that room too, so the
    transfers collide and hang (sglang PRs 24223 and 30723, never merged). So n > 1 goes out as a
    batch of n copies of each prompt with n = 1 and a room each, in SGLang's own sample order
    (prompt by prompt): the choices and outputs come back indexed as n > 1 would have them.
    Chat has no batch form (`parse` refuses n > 1 there).
    """
    if request.copies > 1:
        return _samples_as_batch(body, request, host, port, rooms, salt)
    if request.batch is None:
        fields = f'"bootstrap_host":{json.dumps(host)},"bootstrap_port":{port},"bootstrap_room":{rooms[0]}'
    else:
        fields = (
            f'"bootstrap_host":{json.dumps([host] * request.batch)},'
            f'"bootstrap_port":{json.dumps([port] * request.batch)},"bootstrap_room":{json.dumps(list(rooms))}'
        )
    if salt is not None:  # one string salts every prompt of a batch (io_struct.py _normalize_cache_salt)
        fields += f',"cache_salt":{json.dumps(salt)}'
    # Spliced in before the closing brace instead of re-encoding the whole body (a long prompt
    # makes that the costliest step); JSON keeps the last duplicate key, so ours override a client's.
    # A client's cache_salt is never left in beside ours, though: the body is re-encoded without it.
    stripped = raw.rstrip()
    if stripped.endswith(b"}") and raw.lstrip().startswith(b"{") and (salt is None or _SALT not in body):
        return stripped[:-1] + b"," + fields.encode() + b"}"
    merged = dict(body)
    merged.update(json.loads("{" + fields + "}"))
    return json.dumps(merged, default=memoryview.tolist).encode()  # token ids back to arrays


def _samples_as_batch(
    body: dict[str, Any], request: ParsedRequest, host: str, port: int, rooms: Sequence[int], salt: str | None
) -> bytes:
    """n > 1 as a batch of n = 1 samples, each prompt repeated n times in a row (see with_bootstrap)."""
    n = request.copies
    field = _PROMPT_FIELDS[request.kind]
    if request.kind is Kind.GENERATE and body.get("text") is None:
        field = "input_ids"
    prompts = body[field] if request.batch is not None else [body[field]]
    out = dict(body)
    out[field] = [prompt for prompt in prompts for _ in range(n)]
    if request.kind is Kind.GENERATE:
        out["sampling_params"] = {**body["sampling_params"], "n": 1}
    else:
        out["n"] = 1
    rid = body.get("rid")
    if isinstance(rid, list):  # SGLang wants one rid per prompt of the batch
        out["rid"] = [f"{one}_{i}" for one in rid for i in range(n)]
    out.update(
        bootstrap_host=[host] * request.samples,
        bootstrap_port=[port] * request.samples,
        bootstrap_room=list(rooms),
    )
    if salt is not None:
        out[_SALT] = salt
    return json.dumps(out, default=memoryview.tolist).encode()  # token ids back to arrays


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def completion_tokens(data: bytes) -> int | None:
    """Sum of `completion_tokens` in a response body (usage or meta_info; one per batch item)."""
    found = _COMPLETION_TOKENS.findall(data)
    return sum(int(value) for value in found) if found else None


def last_completion_tokens(data: bytes) -> int | None:
    """The last `completion_tokens` in a stream chunk (usage or cumulative meta_info)."""
    found = _COMPLETION_TOKENS.findall(data)
    return int(found[-1]) if found else None


ANSWER_FLOOR_BYTES = 64 * 1024
"""The least a request's answer may hold: an error body, an answer's wrapping and usage."""
ANSWER_BYTES_PER_SAMPLE = 4 * 1024
"""Per generated item: its choice or `meta_info` (ids, finish reason, counts, timings)."""
ANSWER_BYTES_PER_TOP_LOGPROB = 256
"""Per token and per alternative asked for (`top_logprobs`, `logprobs`, `top_logprobs_num`,
`token_ids_logprob`): an OpenAI entry with its escaped token, logprob and byte list is under 100."""
_BOUNDED_RETURNS = frozenset({"return_logprob", "return_text_in_logprobs"})
"""SGLang's `return_*` fields whose extra output `answer_limit` accounts for; any other one asked
for (hidden states, routed experts, ...) may add more per token than an allowance covers."""


def answer_limit(
    request: ParsedRequest,
    body: dict[str, Any],
    prompt_tokens: int,
    *,
    bytes_per_token: int,
    cap_bytes: int,
) -> int:
    """The most bytes of an engine's answer to this request the router holds (a whole answer, or
    a stream's first event): what the request can legitimately produce, never above `cap_bytes`.

    Each token it may generate (`max_output_tokens` per sample: its limit, else the context
    length) gets `bytes_per_token` plus `ANSWER_BYTES_PER_TOP_LOGPROB` per alternative asked for;
    so does each prompt token (`prompt_tokens`, all samples' prompts together) when the answer
    may repeat the prompt (`echo`, or prompt logprobs from `logprob_start_len` >= 0), and each
    sample `ANSWER_BYTES_PER_SAMPLE`; at least `ANSWER_FLOOR_BYTES`. A request that asks for an
    output the router cannot bound per token (another truthy SGLang `return_*` field), or
    `bytes_per_token` 0, gets `cap_bytes`. An answer past its limit is the engine's lie.
    """
    if bytes_per_token <= 0 or any(
        name.startswith("return_") and name not in _BOUNDED_RETURNS and _truthy(value)
        for name, value in body.items()
    ):
        return cap_bytes
    per_token = bytes_per_token + ANSWER_BYTES_PER_TOP_LOGPROB * _alternatives(request.kind, body)
    tokens = request.max_output_tokens * request.samples
    if _echoes_prompt(request.kind, body):
        tokens += prompt_tokens
    legitimate = tokens * per_token + request.samples * ANSWER_BYTES_PER_SAMPLE
    return min(cap_bytes, max(ANSWER_FLOOR_BYTES, legitimate))


def _alternatives(kind: Kind, body: dict[str, Any]) -> int:
    """Logprob alternatives asked for per token (SGLang's and OpenAI's fields; non-integers are
    the engine's to refuse and count as none)."""
    if kind is Kind.GENERATE:
        ids = body.get("token_ids_logprob")
        return _count(body.get("top_logprobs_num")) + (len(ids) if isinstance(ids, list) else 0)
    field = "top_logprobs" if kind is Kind.CHAT else "logprobs"
    return _count(body.get(field))


def _echoes_prompt(kind: Kind, body: dict[str, Any]) -> bool:
    """Whether the answer may carry the prompt again: `echo` (text and logprobs of the prompt on
    /v1/completions), or /generate's prompt logprobs from `logprob_start_len` >= 0 (SGLang's -1,
    the default, gives the output's only)."""
    if body.get("echo"):
        return True
    if kind is not Kind.GENERATE or not _truthy(body.get("return_logprob")):
        return False
    start = body.get("logprob_start_len")
    starts = start if isinstance(start, list) else [start]
    return any(isinstance(one, int) and not isinstance(one, bool) and one >= 0 for one in starts)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _truthy(value: object) -> bool:
    """A flag, or a batch's list of flags with any set."""
    return any(bool(one) for one in value) if isinstance(value, list) else bool(value)


def _decode(raw: bytes, token_field: str | None, max_batch: int) -> Any:
    """The body as plain Python values, but the token id arrays of `token_field` as uint64 buffers.

    simdjson decodes them in C, with no Python int per token (a 128K-id body: ~3 ms, json: ~20 ms).
    What simdjson refuses goes to json, SGLang's decoder, which accepts UTF-16/32, NaN and
    integers past 64 bits, and says where invalid JSON breaks. Later duplicate keys win, as in json.
    A Parser per call: making one costs nothing, and one that is reused cannot parse while a
    proxy of its previous document lives.
    """
    try:
        document = simdjson.Parser().parse(raw)
    except (ValueError, RuntimeError):  # UnicodeDecodeError is a ValueError
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as err:
            raise ApiError(400, f"request body is not valid JSON: {err}", code="invalid_json") from err
        return _with_token_buffers(body, token_field, max_batch)
    if isinstance(document, simdjson.Object):
        names = list(document)
        # looked up by name, simdjson finds a key's first value, and reads the name only up to a NUL
        if token_field in names and len(set(names)) == len(names) and "\0" not in "".join(names):
            return _decode_token_prompt(raw, document, names, token_field, max_batch)
    return _with_token_buffers(_plain(document), token_field, max_batch)


def _decode_token_prompt(
    raw: bytes, document: simdjson.Object, names: list[str], token_field: str, max_batch: int
) -> Any:
    """The body, its token ids taken by `as_buffer` straight from simdjson's document.

    `as_buffer` flattens arrays nested among the ids, which must be refused. Every JSON array puts
    one '[' in the body: when the body holds no more of them than the arrays known (the prompt's
    and those of the other fields), none hides among the ids. Otherwise (a nested array, or just a
    '[' inside a string) the ids are checked as Python values.
    """
    body = {name: None if name == token_field else _plain(document[name]) for name in names}
    prompt = document[token_field]
    if not (isinstance(prompt, simdjson.Array) and _holds_token_ids(prompt)):
        body[token_field] = _plain(prompt)
    else:
        known = 1 + (len(prompt) if isinstance(prompt[0], simdjson.Array) else 0) + _arrays_in(body.values())
        if _more_brackets_than(raw, known):
            body[token_field] = _token_arrays(token_field, prompt.as_list(), list, token_buffer, max_batch)
        else:
            body[token_field] = _token_arrays(token_field, prompt, simdjson.Array, _uint64_buffer, max_batch)
    return body


def _with_token_buffers(body: Any, token_field: str | None, max_batch: int) -> Any:
    """A body decoded to Python values, its token id arrays turned into uint64 buffers."""
    if isinstance(body, dict) and token_field is not None and _holds_token_ids(body.get(token_field)):
        body[token_field] = _token_arrays(token_field, body[token_field], list, token_buffer, max_batch)
    return body


def _holds_token_ids(prompt: object) -> bool:
    """A non-empty array not of strings: token ids, or a batch of them, or a mistake to name."""
    return isinstance(prompt, list | simdjson.Array) and len(prompt) > 0 and not isinstance(prompt[0], str)


def _token_arrays(
    field: str, prompt: Any, array_type: type, ids_of: Callable[[Any], memoryview], max_batch: int
) -> memoryview | list[memoryview]:
    """One prompt's ids, or a batch's (an array of arrays), as uint64 buffers; ApiError if not ids.

    A batch longer than `max_batch` is refused before a buffer is made for each of its rows.
    """
    try:
        if not isinstance(prompt[0], array_type):
            return ids_of(prompt)
        if len(prompt) > max_batch:
            raise ApiError(
                400,
                f"'{field}' holds {len(prompt)} prompts; this router takes at most {max_batch} per request",
                param=field,
                code="batch_too_large",
            )
        if not all(isinstance(row, array_type) and row for row in prompt):  # rows, none empty
            raise ApiError(
                400,
                f"'{field}' must be an array of non-empty token id arrays",
                param=field,
                code="invalid_type",
            )
        return [ids_of(row) for row in prompt]
    except (TypeError, ValueError) as err:  # a float, string, bool, null, object, negative or > 2**64-1
        raise ApiError(
            400,
            f"'{field}' must hold token ids: integers from 0 to 2**64 - 1",
            param=field,
            code="invalid_type",
        ) from err


def _uint64_buffer(array: simdjson.Array) -> memoryview:
    """The ids of a flat array; TypeError for a non-integer, ValueError for one out of uint64's range."""
    return memoryview(array.as_buffer(of_type="u")).cast("Q")


def _plain(value: Any) -> Any:
    if isinstance(value, simdjson.Array):
        return value.as_list()
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    return value


def _arrays_in(values: Iterable[Any]) -> int:
    """How many JSON arrays some decoded values hold (walked without recursion: any depth)."""
    count, pending = 0, list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, list):
            count += 1
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    return count


def _more_brackets_than(raw: bytes, known: int) -> bool:
    """Whether `raw` holds more than `known` '[' (found by memchr: 20 times faster than counting)."""
    position = -1
    for _ in range(known + 1):
        position = raw.find(b"[", position + 1)
        if position < 0:
            return False
    return True


def _wrong_type(field: str, expected: str, value: object) -> ApiError:
    return ApiError(
        400, f"'{field}' must be {expected}, got {type(value).__name__}", param=field, code="invalid_type"
    )


def _check_sampling_fields(body: dict[str, Any], limits: Limits) -> int:
    """Checks the common OpenAI sampling fields; returns n."""
    n = _check_count(body.get("n"), "n", limits.max_n)
    for field in _NUMBER_FIELDS:
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _wrong_type(field, "a number", value)
    return n


def _check_count(value: object, param: str, most: int) -> int:
    """n: a positive integer, at most `most` (each copy is prefilled, moved and decoded)."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(
            400, f"'{param}' must be a positive integer, got {value!r}", param=param, code="invalid_value"
        )
    if value > most:
        raise ApiError(
            400, f"'{param}' must be at most {most}, got {value}", param=param, code="invalid_value"
        )
    return value


def _check_output_length(
    fields: dict[str, Any], field: str, prefix: str, context_tokens: int
) -> tuple[str, int]:
    """An output length: a non-negative integer no longer than the context; (its name, its value or 0)."""
    value = fields.get(field)
    param = prefix + field
    if value is None:
        return param, 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(
            400, f"'{param}' must be a non-negative integer, got {value!r}", param=param, code="invalid_value"
        )
    if value > context_tokens:
        raise _context_exceeded(param, f"'{param}' is {value}, which", context_tokens)
    return param, value


def _check_context(token_ids: Sequence[memoryview], output: tuple[str, int], context_tokens: int) -> None:
    """Prompts given as token ids are counted exactly: with the output, they must fit the context."""
    param, output_tokens = output
    longest = max((len(ids) for ids in token_ids), default=0)
    if output_tokens and longest + output_tokens > context_tokens:
        raise _context_exceeded(
            param, f"{longest} prompt tokens plus '{param}' {output_tokens}", context_tokens
        )


def _context_exceeded(param: str, what: str, context_tokens: int) -> ApiError:
    return ApiError(
        400,
        f"{what} exceeds the model's context length of {context_tokens} tokens",
        param=param,
        code="context_length_exceeded",
    )


def _chat_text(messages: object) -> str:
    """The conversation as the text the prefix index hashes: the text of every message, in order.

    Roles and the chat template add a few tokens per message that a text estimate cannot see;
    leaving them out keeps the count equal to the engines' own estimate in the testbed.
    """
    if messages is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array of message objects", messages)
    if not messages:
        raise ApiError(
            400, "'messages' must contain at least one message", param="messages", code="empty_array"
        )
    parts: list[str] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _wrong_type(where, "an object", message)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(
                400, f"'{where}.role' must be a non-empty string", param=f"{where}.role", code="invalid_value"
            )
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part_index, part in enumerate(content):
                if not isinstance(part, dict):
                    raise _wrong_type(f"{where}.content[{part_index}]", "an object", part)
                text = part.get("text")
                if part.get("type") == "text":
                    if not isinstance(text, str):
                        raise _wrong_type(f"{where}.content[{part_index}].text", "a string", text)
                    parts.append(text)
        elif content is not None:
            raise _wrong_type(f"{where}.content", "a string or an array of content parts", content)
    return "".join(parts)


def _completion_prompt(prompt: object) -> tuple[tuple[str, ...], tuple[memoryview, ...], int | None]:
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    return _prompt_of("prompt", prompt)


def _generate_prompt(body: dict[str, Any]) -> tuple[tuple[str, ...], tuple[memoryview, ...], int | None]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ApiError(
            400, "exactly one of 'text' or 'input_ids' must be given", param="text", code="invalid_value"
        )
    sampling = body.get("sampling_params")
    if sampling is not None and not isinstance(sampling, dict):
        raise _wrong_type("sampling_params", "an object", sampling)
    if text is not None:
        if not (isinstance(text, str) or (isinstance(text, list) and text and isinstance(text[0], str))):
            raise _wrong_type("text", "a string or a non-empty array of strings", text)
        return _prompt_of("text", text)
    if not (
        isinstance(input_ids, memoryview)
        or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], memoryview))
    ):
        raise _wrong_type("input_ids", "a non-empty array of token ids (or of arrays)", input_ids)
    return _prompt_of("input_ids", input_ids)


def _prompt_of(field: str, prompt: object) -> tuple[tuple[str, ...], tuple[memoryview, ...], int | None]:
    """str -> one text; [str] -> batch of texts; uint64 ids (`_decode`) -> one token prompt; [ids] -> batch."""
    if isinstance(prompt, memoryview):
        return (), (prompt,), None
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, f"'{field}' must not be empty", param=field, code="invalid_value")
        return (prompt,), (), None
    if not isinstance(prompt, list) or not prompt:
        raise _wrong_type(field, "a non-empty string or array", prompt)
    if isinstance(prompt[0], memoryview):
        return (), tuple(prompt), len(prompt)
    if not all(isinstance(item, str) and item for item in prompt):
        raise _wrong_type(field, "an array of non-empty strings", prompt)
    return tuple(prompt), (), len(prompt)
