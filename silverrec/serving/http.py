"""The HTTP connection of `silverrec serve`: uvicorn's httptools protocol, with the answering routes
taken on the connection itself.

A request for POST /v1/search, /v1/recommend or /v1/rank that is plain (HTTP/1.1, the exact path
with no query string, a JSON content type, a Content-Length within the body limit, no Expect or
Upgrade, and no earlier request on the connection still unanswered) is answered here without the
ASGI layers: no scope, receive/send messages or per-request event; its body is collected as the
parser delivers it, parsed and validated at once (the app's `Gate.parse`), queued with the batcher,
and its answer (bytes encoded in the batch's worker thread) goes out in one write with its headers.
Every other request, and a plain one whose body does not parse or fit the route's model, goes the
ASGI way (`Gate`, then FastAPI), which names the problem exactly as it always has; both ways answer
with the same statuses, bodies and headers (the plain way with a Content-Length, not chunked).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

_HEADERS_200 = b"content-type: application/json\r\nx-silverrec-version: "
_INTERNAL_ERROR = (STATUS_LINE[500] + b"content-type: text/plain; charset=utf-8\r\ncontent-length: 21\r\n"
                   b"connection: close\r\n\r\nInternal Server Error")
logger = logging.getLogger("uvicorn.error")


class _NoEvent:
    """What uvicorn sets on a request's cycle when its connection goes (a plain request waits on none)."""

    @staticmethod
    def set() -> None:
        pass


class PlainCycle:
    """A plain request in flight (module docstring): the attributes uvicorn's protocol reads of a
    request cycle (response_complete, disconnected, keep_alive, message_event), its route and body."""

    message_event = _NoEvent

    def __init__(self, route: str, keep_alive: bool, deadline: Optional[bytes]):
        self.route, self.keep_alive, self.deadline = route, keep_alive, deadline
        self.body = bytearray()
        self.response_complete = False
        self.disconnected = False
        self.started = time.perf_counter()


def protocol_for(gate) -> type:
    """uvicorn's `http` protocol class for the app `gate` (serving/app.py's Gate)."""

    class Protocol(PlainProtocol):
        pass

    Protocol.gate = gate
    return Protocol


class PlainProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that answers plain requests itself (module docstring); `gate` is set by
    `protocol_for`."""

    gate = None

    def on_headers_complete(self) -> None:
        cycle = self._plain()
        if cycle is None:
            return super().on_headers_complete()
        self.cycle = cycle

    def _plain(self) -> Optional[PlainCycle]:
        """A PlainCycle for a plain request, None for any other."""
        gate, url = self.gate, self.url
        route = url.decode("latin-1")
        if route not in gate.answering or self.expect_100_continue or self.parser.get_method() != b"POST" \
                or self.parser.get_http_version() != "1.1" or self.parser.should_upgrade() \
                or not (self.cycle is None or self.cycle.response_complete):
            return None
        length = content_type = deadline = None
        for name, value in self.headers:
            if name == b"content-length":
                if length is not None:
                    return None
                length = value
            elif name == b"content-type":
                content_type = value
            elif name == b"x-deadline-ms":
                deadline = value if deadline is None else deadline
            elif name == b"transfer-encoding":
                return None
        if content_type not in gate.json_types or length is None or not length.isdigit() \
                or int(length) > gate.server.config.max_body_bytes:
            return None
        return PlainCycle(route, self.parser.should_keep_alive(), deadline)

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is PlainCycle:
            cycle.body += body
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if type(cycle) is not PlainCycle:
            return super().on_message_complete()
        body = bytes(cycle.body)
        parsed = self.gate.parse(cycle.route, body)
        if parsed is None:  # the ASGI way names the problem
            self.cycle = self._asgi_cycle(body, cycle.keep_alive)
            self._start_asgi_task(self.cycle, self.app)
            return
        task = self.loop.create_task(self._answer(cycle, parsed))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _asgi_cycle(self, body: bytes, keep_alive: bool) -> RequestResponseCycle:
        """The ASGI cycle of a request whose whole body has arrived (uvicorn's on_headers_complete)."""
        scope = self.scope
        scope["method"] = "POST"
        scope["path"] = self.url.decode("latin-1")
        scope["raw_path"] = self.url
        scope["query_string"] = b""
        cycle = RequestResponseCycle(scope=scope, transport=self.transport, flow=self.flow, logger=self.logger,
                                     access_logger=self.access_logger, access_log=self.access_log,
                                     default_headers=self.server_state.default_headers, message_event=asyncio.Event(),
                                     expect_100_continue=False, keep_alive=keep_alive,
                                     on_response=self.on_response_complete)
        cycle.body = bytearray(body)
        cycle.more_body = False
        cycle.message_event.set()  # the whole body is there for its receive()
        return cycle

    async def _answer(self, cycle: PlainCycle, parsed) -> None:
        gate, status = self.gate, 500
        try:
            deadline = cycle.deadline
            reply = await gate.server.submit(None if deadline is None else deadline.decode("latin-1"), parsed,
                                             gate.answering[cycle.route][1])
            status = reply.status
            if cycle.disconnected:
                return
            head = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head += [_HEADERS_200, reply.version.encode(), b"\r\ncontent-length: ", b"%d" % len(reply.body), b"\r\n"]
            if reply.headers:
                for name, value in reply.headers.items():
                    head += [name.lower().encode(), b": ", str(value).encode(), b"\r\n"]
            if not cycle.keep_alive:
                head.append(b"connection: close\r\n")
            head += [b"\r\n", reply.body]
            self.transport.write(b"".join(head))
        except BaseException as e:  # noqa: BLE001  (uvicorn's answer to an app that raised)
            status = 500
            logger.error("Exception in ASGI application\n", exc_info=e)
            cycle.keep_alive = False
            if not cycle.disconnected:
                self.transport.write(_INTERNAL_ERROR)
        finally:
            gate.server.metrics.observe(cycle.route, status, time.perf_counter() - cycle.started)
            cycle.response_complete = True
            if not cycle.keep_alive:
                self.transport.close()
            if not cycle.disconnected:
                self.on_response_complete()
