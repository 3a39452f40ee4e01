"""Which requests the studio answers, decided from the request line and headers alone.

The browser does not keep the ports of one host apart: a page served from another port of
127.0.0.1 (a notebook, a TensorBoard, `python -m http.server` over a downloaded file) is
"same-site" to the studio, gets every cookie of 127.0.0.1, and may post plain HTML forms at it.
So the studio sets no cookie at all: its page keeps the token in its own origin's localStorage
(which no other port can read) and sends it as `Authorization: Bearer <token>` on every API call,
a header no form can send and no other origin's script can add without a CORS preflight the
studio refuses. On top of that:

- Host must be a name of this machine (loopback, or the address served on): a rebinding DNS name
  pointed at 127.0.0.1 is refused, whatever the token.
- Origin, when sent, must be the studio's own (http:// and the Host the browser addressed).
- Sec-Fetch-Site, when sent, must be same-origin (a typed URL, "none", may also read).
- Anything but GET and HEAD must be `Content-Type: application/json` with a Content-Length of at
  most MAX_BODY bytes.

The pages' HTML shells and the static files need no token: they hold no data; their content comes
from the API.
"""

from __future__ import annotations

import secrets

# a request body above this is refused before it is read (a composition is a few kB)
MAX_BODY = 1 << 20
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
READS = ("GET", "HEAD")
# on every answer: no other page may frame the studio (a click on "launch" through a transparent
# frame); only the studio's own script files run (text from a run's files that slipped into the
# page unescaped would not: it could read the token); no address is sent on; no answer is sniffed
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
HEADERS = {"X-Frame-Options": "DENY", "Content-Security-Policy": CSP,
           "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}


def host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8765" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def bearer(headers) -> str:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def refusal(method: str, path: str, headers, hosts: frozenset[str], token: str) -> tuple[int, str] | None:
    """(status, one-line reason) for a request the studio refuses, None for one it answers."""
    host = headers.get("host", "")
    if host_name(host) not in hosts:
        return 403, (f"refused: Host {host!r} is not a name this studio serves on ({', '.join(sorted(hosts))}); "
                     f"a page that reached it through another name (DNS rebinding) is refused. Open the URL it printed.")
    origin = headers.get("origin")
    if origin is not None and origin.lower() != f"http://{host.lower()}":
        return 403, (f"refused: a request from the page at {origin}, not from the studio's own page "
                     f"(http://{host}); other pages, other ports of this host included, cannot use the studio.")
    api = path.startswith("/api/")
    site = headers.get("sec-fetch-site")
    if api and site is not None and site not in (("same-origin", "none") if method in READS else ("same-origin",)):
        return 403, (f"refused: a {site} request (Sec-Fetch-Site); the studio answers only its own page "
                     f"(a page on another port of this host is same-site, and refused).")
    if method not in READS:
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            return 415, f"refused: Content-Type {kind or '(none)'!r}; send the body as JSON, with Content-Type: application/json."
        length = headers.get("content-length", "")
        if "transfer-encoding" in headers or not length.isdigit():
            return 411, "refused: a request body needs its Content-Length (no chunked bodies)."
        if int(length) > MAX_BODY:
            return 413, f"refused: a body of {int(length)} bytes; the studio takes at most {MAX_BODY}."
    if api and not secrets.compare_digest(bearer(headers).encode(), token.encode()):
        return 401, ("refused: the rft studio needs its token in 'Authorization: Bearer <token>' (its page sends it: "
                     "open the URL `python -m rft.studio` printed, http://.../compose#token=...).")
    return None
