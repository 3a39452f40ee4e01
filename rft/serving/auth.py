"""What the project's HTTP servers share (the reward server, the explorer's OpenAI-compatible
endpoint, the studio): the token check, the token read from the environment or a file, limits on
what a client may send or hold, and the listening socket.

Limits, each measured against `python -m rft.serving.reward_server` (tests/test_reward_server.py):
- a request body over `max_body` bytes is answered 413 when its Content-Length says so, or as a
  chunked body passes the limit, and the app never holds more of it (BodyLimit);
- a request must arrive whole, head and body, within `request_timeout` seconds of its connection
  (or of the previous answer on a kept-alive one); else the connection is closed. uvicorn times out
  idle kept-alive connections only: a client sending its head a byte at a time held a connection
  for as long as it liked (TimedH11);
- a client must read its answer: one that reads none of it while the server has more to send
  (past the 64 KiB transport buffer) has its connection dropped after `request_timeout` seconds,
  or the time to read at 1 KiB/s what its kernel took (up to 256 s: a reader is seen only as its
  kernel takes more, in steps of half its buffer, so a client reading 1 KiB/s is never dropped).
  uvicorn waited for it forever: ten connections asking for the studio's plotly.min.js (no token
  needed) and never reading held a studio of --max-connections 8 at 503 for good (TimedH11);
- at most `max_connections` connections at once: beyond, a request is answered 503 (uvicorn's
  limit_concurrency), which the clients retry. The slots are the server's, not a client
  address's (every local user is 127.0.0.1). A connection that has not yet sent the server's token
  holds its slot only until one is wanted: a connection that would be over the limit closes the
  oldest such one to take its place (TimedH11). So connections held open without the token, however
  fast they are opened again, never keep a client with the token out; only connections that sent
  it count against the limit for good (a client of the server's own, or anyone who has the token);
- an unfinished request head over 16 KiB is answered 400 (h11's default limit, stated in
  server_config; a head that one read brings in whole, up to 64 KiB, is parsed).
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import os
import secrets
import socket
import stat
import sys

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_BODY = 32 * 2**20  # a group of 64 responses of 128k characters is 8 MiB
REQUEST_TIMEOUT = 10.0
MAX_CONNECTIONS = 256  # above the clients' pools: 8 explorers x 8 kept-alive connections is 64
MAX_HEAD = 16 * 2**10
MIN_READ_RATE = 2**10  # bytes/s: a client reading at least this fast is never dropped (TimedH11)
MAX_UNREAD = 256 * 2**10  # the most a client is assumed to hold unread (the kernel's default buffer takes ~175 KB)


def bearer_refusal(request, expected: bytes, which: str):
    """None for a request whose `Authorization: Bearer` token is `expected` (compared in constant
    time), else the 401 response (JSON `{"detail": ...}`) saying what was wrong; `which` says which
    token to send."""
    from fastapi.responses import JSONResponse

    header = request.headers.get("authorization")
    if header is None:
        why = "no Authorization header"
    else:
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), expected):
            return None
        why = "a wrong token" if scheme.lower() == "bearer" else "an Authorization header that is not Bearer"
    return JSONResponse({"detail": f"refused: {why}. Send 'Authorization: Bearer <token>', {which}."},
                        status_code=401, headers={"WWW-Authenticate": "Bearer"})


def read_token(env: str, token_file: str | None, prog: str) -> str | None:
    """The token from `token_file` (its first line), else from $`env`, else None. Never from the
    command line: every local user sees a process's arguments in `ps`. A file that cannot be read
    or is empty exits with one line; one that other users can read is used, with a warning. The
    spaces and line break around it are not part of it."""
    if token_file is None:
        return (os.environ.get(env) or "").strip() or None
    try:
        with open(token_file, encoding="utf-8") as f:
            token = f.readline().strip()
        mode = os.stat(token_file).st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"{prog}: --token-file {token_file}: cannot read it ({getattr(e, 'strerror', None) or e}). "
                         f"Write the token on its first line, or set ${env} instead.") from None
    if not token:
        raise SystemExit(f"{prog}: --token-file {token_file} is empty: write the token on its first line.")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(f"{prog}: WARNING: {token_file} can be read by other users (mode {stat.S_IMODE(mode):o}); "
              f"`chmod 600 {token_file}` keeps the token yours.", file=sys.stderr, flush=True)
    return token


class BodyTooLarge(HTTPException):
    """Raised where the app reads a body over the limit; an HTTPException, so that FastAPI answers
    it (413, `{"detail": ...}`) unless the app has a handler of its own. The connection is closed
    after the answer: the rest of the body is never read."""

    def __init__(self, limit: int, hint: str = ""):
        super().__init__(413, f"the request body is over the {limit / 2**20:g} MiB this server accepts{hint}.",
                         headers={"Connection": "close"})


class BodyLimit:
    """ASGI middleware (app.add_middleware(BodyLimit, limit=..., hint=...)): the app's reads of a
    request body raise BodyTooLarge once the body is over `limit` bytes, at the first read when its
    Content-Length says so. The body is read only when the app asks for it, after its token check."""

    def __init__(self, app, limit: int, hint: str = ""):
        self.app, self.limit, self.hint = app, limit, hint

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        seen = 0

        async def limited():
            nonlocal seen
            if declared.isdigit() and int(declared) > self.limit:
                raise BodyTooLarge(self.limit, self.hint)
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(self.limit, self.hint)
            return message

        await self.app(scope, limited, send)


_OPENED = itertools.count()  # the order connections opened in: the oldest untrusted one makes room


def _answering(conn) -> bool:
    """Whether `conn` (a uvicorn H11Protocol) has a request whose answer is under way and being
    read: not one whose client has stopped reading it (its writes paused), which is the hold on a
    slot this is against (a client asking for a large file and reading none of it)."""
    cycle, flow = getattr(conn, "cycle", None), getattr(conn, "flow", None)
    return cycle is not None and not cycle.response_complete and not (flow is not None and flow.write_paused)


class TimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request to arrive whole (see the module
    docstring): armed when a connection opens and after each answer, disarmed once the request's
    head and body are in, so a slow reward or engine call is never cut."""

    def connection_made(self, transport) -> None:
        self._deadline = self._stalled = None
        self._trusted, self._since = False, next(_OPENED)
        super().connection_made(transport)
        self._arm()
        self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.DONE and self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if not self._trusted and self.headers is not None:  # a request's head is in: did it bring the token?
            self._trusted = sends_token(self.headers, getattr(self.config, "token", None))

    def _make_room(self) -> None:
        """Over the limit with this connection (uvicorn would answer its request 503): close the
        oldest other connection that has not sent the token, if there is one (module docstring)."""
        limit = self.config.limit_concurrency
        if limit is None or len(self.connections) < limit or getattr(self.config, "token", None) is None:
            return
        # not one whose request is being answered (a page or asset the studio serves without the
        # token): cut mid-answer, a browser under load lost it. A request held half-sent is the
        # kind this is against, and the request deadline drops one whose body never comes
        idle = [c for c in self.connections if c is not self and not getattr(c, "_trusted", True)
                and not _answering(c)]
        if idle:
            oldest = min(idle, key=lambda c: c._since)
            oldest.transport.abort()
            self.connections.discard(oldest)  # now: its connection_lost comes on the loop's next turn

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is not h11.DONE and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        for timer in (self._deadline, self._stalled):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    # the transport calls these as its write buffer passes the high and low water marks: a client
    # that reads nothing of its answer while more is to be sent is dropped (abort: close() would
    # wait to send it the buffered rest, forever). Any read is progress, but the server sees a read
    # only when the client's kernel takes more, which it does in steps: its window reopens once it
    # has room for half its buffer (measured on loopback with the kernel's buffers: ~175 KB taken at
    # once, then nothing for 15 s while a client read 8 KiB/s), so a client is given the time to read
    # all its kernel may hold unread at 1 KiB/s (MIN_READ_RATE), and request_timeout at least. A
    # client that reads nothing is indistinguishable meanwhile: dropped after ~171 s with the
    # kernel's default buffers, MAX_UNREAD / MIN_READ_RATE at most; after less as its kernel takes less
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            taken = _bytes_taken(self.transport)
            self._look_for_progress(self._unsent(), taken, self._allowance(taken), self.loop.time())

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _unsent(self) -> int:
        return self.transport.get_write_buffer_size()

    def _allowance(self, taken: int | None) -> float:
        """Seconds a client whose kernel has taken `taken` bytes (all of which it may hold unread)
        may go without taking more."""
        return max(self.config.request_timeout, min(taken or 0, MAX_UNREAD) / MIN_READ_RATE)

    def _look_for_progress(self, size: int, taken: int | None, allowed: float, since: float) -> None:
        """Looked at 4 times a request_timeout: dropped once the client's kernel has taken nothing
        more (bytes acknowledged, `taken` at the last look; where the kernel does not say, the
        buffer, `size` bytes at the last look, not shrinking) for `allowed` seconds since `since`."""
        def look() -> None:
            now, left, took = self.loop.time(), self._unsent(), _bytes_taken(self.transport)
            moved = took > taken if took is not None and taken is not None else left < size
            if not moved and now - since >= allowed:
                self._stalled = None
                self.transport.abort()
            elif moved:
                self._look_for_progress(left, took, self._allowance(took), now)
            else:
                self._look_for_progress(left, took, allowed, since)

        self._stalled = self.loop.call_later(self.config.request_timeout / 4, look)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.config.request_timeout, self._too_slow)

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def _bytes_taken(transport) -> int | None:
    """Bytes of the connection's answers the client's kernel has acknowledged (Linux's TCP_INFO
    tcpi_bytes_acked, at offset 120), or None where the kernel does not say."""
    sock = transport.get_extra_info("socket")
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 128)
    except (AttributeError, OSError):
        return None
    return int.from_bytes(info[120:128], sys.byteorder) if len(info) >= 128 else None


def sends_token(headers, token: bytes | None) -> bool:
    """Whether a request's headers (uvicorn's: lower-case names, bytes) carry `Authorization:
    Bearer <token>` (compared in constant time)."""
    if token is None:
        return False
    for name, value in headers:
        if name == b"authorization":
            scheme, _, given = value.partition(b" ")
            return scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), token)
    return False


def server_config(app, *, request_timeout: float = REQUEST_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                  token: str | None = None, **kwargs):
    """The uvicorn.Config of a server of this project: TimedH11 with `request_timeout`, uvicorn's
    limit_concurrency at `max_connections`, h11's head limit; `token`: the one the app checks, so
    that connections without it give up their slots (module docstring); `kwargs` go to uvicorn.Config."""
    import uvicorn

    config = uvicorn.Config(app, http=TimedH11, limit_concurrency=max_connections,
                            h11_max_incomplete_event_size=MAX_HEAD, **kwargs)
    config.request_timeout = request_timeout
    config.token = token.encode() if token else None
    return config


# ---------------------------------------------------------------- listening

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int, prog: str) -> tuple[socket.socket, str, int]:
    """A socket bound and listening on host:port (0: any free port), for uvicorn to serve on:
    (socket, the host as a URL writes it, the port). A port in use exits with one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise SystemExit(f"{prog}: cannot listen on {host}:{port}: {e}. Choose another --port (0: any free one).")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock, f"[{host}]" if family == socket.AF_INET6 else host, sock.getsockname()[1]


def positive(kind):
    """An argparse type: `kind` of the text, which must be > 0."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value
    return parse
