"""Who may call the server and how much they may send.

`Guard` is an ASGI middleware in front of every route: it checks `Authorization: Bearer KEY`
when a key is set (before the body is even read) and refuses a body larger than the cap
(413), whether the client declared its length or not. `check_bind` refuses to listen beyond
loopback without a key.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from collections.abc import Awaitable, Callable

from strata_runtime.serving.protocol import error_body

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
"""Paths served without the key (liveness probes)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_bind(host: str, api_key: str | None) -> None:
    """ValueError if `host` is not loopback and there is no API key."""
    if not is_loopback(host) and not api_key:
        raise ValueError(f"--host {host} is not a loopback address: set an API key "
                         "(--api-key, or the STRATA_API_KEY environment variable) to serve it")


class Guard:
    """API key and body-size checks for `app`."""

    def __init__(self, app: App, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self._expected = None if not api_key else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self._expected is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                await _refuse(send, 401, "a valid API key is needed: send the header "
                              "'Authorization: Bearer KEY'", "invalid_api_key")
                return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            await _refuse(send, 413, self._too_large(), "request_too_large")
            return
        body = await self._read(receive)
        if body is None:
            await _refuse(send, 413, self._too_large(), "request_too_large")
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_body_bytes} bytes"

    async def _read(self, receive: Receive) -> list[Message] | None:
        """The body messages, or None past the cap (a chunked body has no content-length)."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that hands out the buffered body first, then the connection's own messages
    (a later http.disconnect)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
