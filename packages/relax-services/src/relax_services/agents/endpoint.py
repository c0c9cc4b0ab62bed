"""A minimal HTTP/1.1 server for the black-box agent's chat-completions endpoint, on the standard library.

It binds 127.0.0.1 on an ephemeral port and serves ``POST /<session>/v1/chat/completions`` (and ``GET
/<session>/v1/models``); the session is the path's first segment, or the ``Authorization: Bearer`` key for a client
whose base URL is the bare ``/v1``. Bodies are JSON with a ``Content-Length`` (what ``httpx``, under the ``openai``
package, sends); connections are kept alive. ``asyncio`` streams run it on the event loop that runs the agents, so a
request costs no thread and no dependency: the endpoint is local and its one client is the agent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

__all__ = ["ChatEndpoint", "HttpError", "Reply"]

Reply = tuple[int, dict[str, object]]
"""An HTTP status and its JSON body."""

MAX_BODY_BYTES = 64 << 20
"""Largest request body accepted (a long conversation is well under it)."""

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 409: "Conflict"}
_REASONS |= {411: "Length Required", 413: "Payload Too Large", 500: "Internal Server Error"}


class HttpError(Exception):
    """A request the endpoint answers with an error in OpenAI's schema.

    Args:
        status: The HTTP status.
        message: What was wrong.
        code: A short machine-readable code.
    """

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def reply(self) -> Reply:
        """The error as OpenAI's API writes one."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return self.status, {"error": {"message": str(self), "type": kind, "code": self.code}}


Handler = Callable[[str, str, dict[str, object]], Awaitable[Reply]]
"""``(session, route, body) -> reply``; ``route`` is ``chat`` or ``models``."""


class ChatEndpoint:
    """The endpoint's server; :meth:`start` it inside the event loop that runs the agents.

    Args:
        handler: Answers each request of a session.
    """

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        """Binds 127.0.0.1 on an ephemeral port (:attr:`port`)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def base_url(self, session: str) -> str:
        """The OpenAI base URL of one session."""
        return f"http://127.0.0.1:{self.port}/{session}/v1"

    async def close(self) -> None:
        """Stops listening and closes the connections still open."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, UnicodeDecodeError):
            pass  # the client went away or sent something that is not HTTP: drop the connection
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Reads one request and writes its reply; False when the connection is over."""
        line = await reader.readline()
        if not line.strip():
            return False
        method, target, *_ = line.decode("latin-1").split()
        headers: dict[str, str] = {}
        while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = header.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        keep = headers.get("connection", "").lower() != "close"
        try:
            if "chunked" in headers.get("transfer-encoding", "").lower():
                keep = False
                raise HttpError(411, "send the body with a Content-Length")
            size = int(headers.get("content-length", "0"))
            if size > MAX_BODY_BYTES:
                keep = False
                raise HttpError(413, f"request body of {size} bytes is over {MAX_BODY_BYTES}")
            body = await reader.readexactly(size) if size else b""
            status, payload = await self._route(method, target, headers, body)
        except HttpError as exc:
            status, payload = exc.reply()
        except Exception as exc:  # a fault of the server's own: the agent sees it as a 500, the server goes on
            status, payload = HttpError(500, f"{type(exc).__name__}: {exc}", "server_error").reply()
        data = json.dumps(payload).encode()
        head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n"
        writer.write(head.encode() + data)
        await writer.drain()
        return keep

    async def _route(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Reply:
        path = [part for part in target.split("?", 1)[0].split("/") if part] or [""]
        if path[:1] == ["v1"]:  # the bare base URL: the session is the API key
            auth = headers.get("authorization", "")
            session = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            rest = path[1:]
        else:
            session, rest = path[0], path[2:] if path[1:2] == ["v1"] else ["?"]
        if method == "POST" and rest == ["chat", "completions"]:
            try:
                request = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise HttpError(400, f"the body is not JSON: {exc}") from None
            if not isinstance(request, dict):
                raise HttpError(400, "the body must be a JSON object")
            return await self.handler(session, "chat", request)
        if method == "GET" and rest == ["models"]:
            return await self.handler(session, "models", {})
        raise HttpError(404, f"{method} {target}: this endpoint serves POST /v1/chat/completions", "not_found")
