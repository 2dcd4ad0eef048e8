"""An engine that misbehaves on purpose, on a raw socket: `python faulty_engine.py --port P --fault F`.

GET (health checks) answers 200, except under `busy`, where it answers late while a request is
in flight (as a decode busy with long answers does). Every POST meets the fault:

- `500`: SGLang's JSON error, HTTP 500
- `late-500`: the same after `--busy-seconds` (a prefill that dies while its decode waits)
- `413`: a plain-text 413, as SGLang's HTTP server answers an oversized body
- `302`: a redirect elsewhere (SGLang never redirects)
- `empty`: a 200 with an empty body
- `endless`: a 200 JSON answer without a length whose body never ends
- `endless-stream`: a 200 SSE stream of token events that never ends
- `garbage`: bytes that are not HTTP, then close
- `truncated`: a 200 whose body stops short of its Content-Length, then close
- `hang`: a 200's headers (an SSE stream), then silence
- `stall`: a 200 SSE stream with one token, then silence
- `cut`: a 200 SSE stream with one token, then close (a decode dying mid-stream)
- `abort`: a 200 SSE stream with one token, then SGLang's error event and [DONE] (an abort
  after the stream started: openai/serving_chat.py, the abort branch of _generate_chat_stream)
- `busy`: a valid chat completion after `--busy-seconds`, nothing sent before it
- `ok`: a valid answer at once (a prefill that needs no decode to pull its KV)

With `--loads-file F` a GET of /v1/loads answers F's bytes, with `--metrics-file F` a GET of
/metrics does (reports that lie: numbers out of range, pages too large).

With `--bootstrap-port` it also holds a bootstrap port that accepts and never answers, so a
decode paired with it waits for its KV instead of failing at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

_COMPLETION = json.dumps(
    {
        "id": "faulty",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
_SGLANG_ERROR = json.dumps(
    {"object": "error", "message": "boom", "type": "InternalServerError", "param": None, "code": 500}
).encode()


_SGLANG_STREAM_ERROR = json.dumps(
    {
        "error": {
            "object": "error",
            "message": "Generation aborted.",
            "type": "INTERNAL_SERVER_ERROR",
            "param": None,
            "code": 500,
        }
    }
).encode()


def _answer(status: str, content_type: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class FaultyEngine:
    def __init__(self, fault: str, busy_seconds: float, reports: dict[bytes, bytes]) -> None:
        self.fault = fault
        self.busy_seconds = busy_seconds
        self.reports = reports  # path prefix -> the GET answer's body
        self.in_flight = 0

    def _get(self, path: bytes) -> bytes:
        for prefix, body in self.reports.items():
            if path.startswith(prefix):
                return _answer("200 OK", "application/json", body)
        return _answer("200 OK", "text/plain", b"ok")

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if method == b"GET":
                    if self.fault == "busy" and self.in_flight:
                        await asyncio.sleep(self.busy_seconds)
                    writer.write(self._get(path))
                    continue
                if not await self._post(writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _post(self, writer: asyncio.StreamWriter) -> bool:
        """Answers one POST with the fault; False when the connection is to be closed."""
        fault = self.fault
        if fault in ("500", "late-500"):
            if fault == "late-500":
                await asyncio.sleep(self.busy_seconds)
            writer.write(_answer("500 Internal Server Error", "application/json", _SGLANG_ERROR))
        elif fault == "302":
            writer.write(b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:9/\r\nContent-Length: 0\r\n\r\n")
        elif fault == "empty":
            writer.write(_answer("200 OK", "application/json", b""))
        elif fault in ("endless", "endless-stream"):
            kind = "application/json" if fault == "endless" else "text/event-stream"
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nConnection: close\r\n\r\n".encode())
            event = b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n'
            piece = b'{"choices": [' + b" " * 65536 if fault == "endless" else event * 64
            while True:  # until the router hangs up
                writer.write(piece)
                await writer.drain()
        elif fault == "413":
            writer.write(_answer("413 Request Entity Too Large", "text/plain", b"Request Entity Too Large"))
        elif fault == "garbage":
            writer.write(b"\x16\x03\x01 this is not HTTP \xff\xfe\r\n\r\n")
            return False
        elif fault == "truncated":
            writer.write(_answer("200 OK", "application/json", _COMPLETION)[:-20])
            await writer.drain()
            return False
        elif fault in ("hang", "stall", "cut", "abort"):
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            events = [b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n']
            if fault == "abort":
                events += [b"data: " + _SGLANG_STREAM_ERROR + b"\n\n", b"data: [DONE]\n\n", b""]
            if fault != "hang":
                for event in events:
                    writer.write(b"%x\r\n%b\r\n" % (len(event), event))
                await writer.drain()
                if fault != "stall":
                    return fault == "abort"
            await asyncio.sleep(3600)
        elif fault == "busy":
            self.in_flight += 1
            try:
                await asyncio.sleep(self.busy_seconds)
            finally:
                self.in_flight -= 1
            writer.write(_answer("200 OK", "application/json", _COMPLETION))
        else:
            writer.write(_answer("200 OK", "application/json", _COMPLETION))
        return True


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()  # until the peer goes
    writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bootstrap-port", type=int)
    parser.add_argument(
        "--fault",
        required=True,
        choices=[
            "500",
            "late-500",
            "413",
            "302",
            "empty",
            "endless",
            "endless-stream",
            "garbage",
            "truncated",
            "hang",
            "stall",
            "cut",
            "abort",
            "busy",
            "ok",
        ],
    )
    parser.add_argument("--busy-seconds", type=float, default=2.0)
    parser.add_argument("--loads-file")
    parser.add_argument("--metrics-file")
    args = parser.parse_args()
    reports = {
        prefix: Path(name).read_bytes()
        for prefix, name in ((b"/v1/loads", args.loads_file), (b"/metrics", args.metrics_file))
        if name
    }
    engine = FaultyEngine(args.fault, args.busy_seconds, reports)
    servers = [await asyncio.start_server(engine.serve, args.host, args.port)]
    if args.bootstrap_port is not None:
        servers.append(await asyncio.start_server(_silent, args.host, args.bootstrap_port))
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    asyncio.run(main())
