"""Request bodies in, PD bodies out: validation, prompt extraction, bootstrap fields (pure).

Only what routing needs is checked here (the prompt, `stream`, `model`, a few common sampling
fields); everything else is the engine's to validate, and its 4xx answers pass through. Errors
are OpenAI-style: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prfaas_router.prefix_index import PromptKey, key_for_text, key_for_tokens


class Kind(enum.StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETION = "/v1/completions"
    GENERATE = "/generate"


class ApiError(Exception):
    """An answer the client gets instead of a completion."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
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
class ParsedRequest:
    kind: Kind
    stream: bool
    model: str | None
    texts: tuple[str, ...]  # prompts as text (empty when token ids are given)
    token_ids: tuple[Sequence[int], ...]  # prompts as token ids
    copies: int  # OpenAI's n: each prompt is generated (and prefilled, and moved) n times
    batch: int | None  # items (prompts x n) of a batched request: bootstrap fields become arrays


_INT_FIELDS = ("max_tokens", "max_completion_tokens")
_NUMBER_FIELDS = ("temperature", "top_p")


def parse(kind: Kind, raw: bytes) -> tuple[dict[str, Any], ParsedRequest]:
    """Decode and check a request body; raises ApiError naming the offending field."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"request body is not valid JSON: {err}", code="invalid_json") from err
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
    else:
        copies = _check_sampling_fields(body)
        if kind is Kind.CHAT:
            texts, token_ids, batch = (_chat_text(body.get("messages")),), (), None
        else:
            texts, token_ids, batch = _completion_prompt(body.get("prompt"))
        if copies > 1:
            batch = len(texts or token_ids) * copies
    return body, ParsedRequest(kind, bool(stream), model, texts, token_ids, copies, batch)


def prompt_keys(request: ParsedRequest, block_size_tokens: int, chars_per_token: float) -> list[PromptKey]:
    """One key per generated item: a prompt asked for n times is prefilled and shipped n times.

    The keys hash lazily: hashing token ids that hold an array or object raises TypeError,
    which `unhashable_token_ids` turns into the client's error.
    """
    if not request.token_ids:
        keys = [key_for_text(text, block_size_tokens, chars_per_token) for text in request.texts]
    else:
        keys = [key_for_tokens(ids, block_size_tokens) for ids in request.token_ids]
    return keys * request.copies


def unhashable_token_ids() -> ApiError:
    """An array or object where a token id belongs, met while hashing the prompt."""
    return ApiError(400, "token ids must be integers", param="input_ids", code="invalid_type")


def with_bootstrap(
    raw: bytes, body: dict[str, Any], host: str, port: int, rooms: Sequence[int], batch: int | None
) -> bytes:
    """The same body with SGLang's PD fields, arrays for a batch; ours override any sent by the client.

    The fields are spliced in before the closing brace instead of re-encoding the whole body
    (a long prompt makes that the costliest step); JSON keeps the last duplicate key.
    """
    if batch is None:
        fields = f'"bootstrap_host":{json.dumps(host)},"bootstrap_port":{port},"bootstrap_room":{rooms[0]}'
    else:
        fields = (
            f'"bootstrap_host":{json.dumps([host] * batch)},"bootstrap_port":{json.dumps([port] * batch)},'
            f'"bootstrap_room":{json.dumps(list(rooms))}'
        )
    stripped = raw.rstrip()
    if stripped.endswith(b"}") and raw.lstrip().startswith(b"{"):
        return stripped[:-1] + b"," + fields.encode() + b"}"
    merged = dict(body)
    merged.update(json.loads("{" + fields + "}"))
    return json.dumps(merged).encode()


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def completion_tokens(data: bytes) -> int | None:
    """Sum of `completion_tokens` in a response body (usage or meta_info; one per batch item)."""
    found = _COMPLETION_TOKENS.findall(data)
    return sum(int(value) for value in found) if found else None


def last_completion_tokens(data: bytes) -> int | None:
    """The last `completion_tokens` in a stream chunk (usage or cumulative meta_info)."""
    found = _COMPLETION_TOKENS.findall(data)
    return int(found[-1]) if found else None


def _wrong_type(field: str, expected: str, value: object) -> ApiError:
    return ApiError(
        400, f"'{field}' must be {expected}, got {type(value).__name__}", param=field, code="invalid_type"
    )


def _check_sampling_fields(body: dict[str, Any]) -> int:
    """Checks the common OpenAI sampling fields; returns n."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ApiError(400, f"'n' must be a positive integer, got {n!r}", param="n", code="invalid_value")
    for field in _INT_FIELDS:
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ApiError(
                400,
                f"'{field}' must be a non-negative integer, got {value!r}",
                param=field,
                code="invalid_value",
            )
    for field in _NUMBER_FIELDS:
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _wrong_type(field, "a number", value)
    return n or 1


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
            raise ApiError(400, f"'{where}.role' must be a non-empty string", param=f"{where}.role")
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


def _completion_prompt(prompt: object) -> tuple[tuple[str, ...], tuple[Sequence[int], ...], int | None]:
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    return _prompt_of("prompt", prompt)


def _generate_prompt(body: dict[str, Any]) -> tuple[tuple[str, ...], tuple[Sequence[int], ...], int | None]:
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
    if not (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], int | list)):
        raise _wrong_type("input_ids", "a non-empty array of token ids (or of arrays)", input_ids)
    return _prompt_of("input_ids", input_ids)


def _prompt_of(field: str, prompt: object) -> tuple[tuple[str, ...], tuple[Sequence[int], ...], int | None]:
    """str -> one text; [str] -> batch of texts; [int] -> one token prompt; [[int]] -> batch."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, f"'{field}' must not be empty", param=field, code="invalid_value")
        return (prompt,), (), None
    if not isinstance(prompt, list) or not prompt:
        raise _wrong_type(field, "a non-empty string or array", prompt)
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(item, str) and item for item in prompt):
            raise _wrong_type(field, "an array of non-empty strings", prompt)
        return tuple(prompt), (), len(prompt)
    if isinstance(first, list):
        if not all(isinstance(item, list) and item and _looks_like_ids(item) for item in prompt):
            raise _wrong_type(field, "an array of non-empty token id arrays", prompt)
        return (), tuple(prompt), len(prompt)
    if not _looks_like_ids(prompt):
        raise _wrong_type(field, "an array of integer token ids", prompt)
    return (), (prompt,), None


def _looks_like_ids(ids: list[Any]) -> bool:
    """Checks the ends only: a full scan of a 128K-token prompt costs milliseconds; the engine checks all."""
    return all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (ids[0], ids[-1]))
