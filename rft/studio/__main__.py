"""python -m rft.studio [--host 127.0.0.1] [--port 8765] [--root ./checkpoints] [--token-file FILE]
                       [--request-timeout 10] [--max-connections 256]

Serves the studio on loopback with a fresh token in the printed URL (or the one in
$RFT_STUDIO_TOKEN or --token-file: never on the command line, where `ps` shows it to every local
user); --host to share it deliberately (plain HTTP: anyone who can reach the port and has the
token can launch runs). As the project's servers (rft.serving.auth), a request has --request-timeout
seconds to arrive whole (and its client as long to read on in the answer) and at most
--max-connections are served at once (503 beyond): connections held open half-sent or unread, which
need no token, cannot spend the studio's files.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
from pathlib import Path
from urllib.parse import quote

REPO = Path(__file__).resolve().parents[2]
TOKEN_ENV = "RFT_STUDIO_TOKEN"
# a shorter token can be guessed by trying: the studio answers as fast as it can
MIN_TOKEN = 16


def read_token(path: str | None) -> str:
    """The token from --token-file, else $RFT_STUDIO_TOKEN, else a fresh one; a SystemExit naming
    the source when it is unreadable, empty or short."""
    if path:
        file = Path(path).expanduser()
        try:
            token, source = file.read_text().strip(), f"--token-file {path}"
        except (OSError, UnicodeDecodeError) as e:  # a binary file was a traceback
            raise SystemExit(f"rft.studio: --token-file {path}: cannot read it "
                             f"({getattr(e, 'strerror', None) or 'not UTF-8 text'}).")
        if file.stat().st_mode & 0o077:
            print(f"rft.studio: WARNING: --token-file {path} is readable by other users: chmod 600 {path}",
                  file=sys.stderr, flush=True)
    elif os.environ.get(TOKEN_ENV):
        token, source = os.environ[TOKEN_ENV], f"${TOKEN_ENV}"
    else:
        return secrets.token_urlsafe(24)
    from rft.rewards.remote import NEW_TOKEN, UNSENDABLE, sendable

    # the page sends the token in a header: a letter outside ASCII was a studio refusing its own page
    if not sendable(token):
        raise SystemExit(f"rft.studio: the token in {source} {UNSENDABLE}: {NEW_TOKEN}.")
    if len(token) < MIN_TOKEN:
        raise SystemExit(f"rft.studio: the token in {source} is shorter than {MIN_TOKEN} characters: {NEW_TOKEN}.")
    return token


def host_names(host: str) -> frozenset[str]:
    """The names a request's Host may give: loopback's, the address bound, and where that is every
    address (0.0.0.0, ::), this machine's name and addresses."""
    from rft.studio.guard import LOOPBACK

    names = set(LOOPBACK) | {host}
    if host in ("0.0.0.0", "::"):
        names |= {socket.gethostname(), socket.getfqdn()}
        try:
            names |= {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        except OSError:
            pass
    return frozenset(n.lower() for n in names)


def _parser() -> argparse.ArgumentParser:
    from rft.serving.auth import MAX_CONNECTIONS, REQUEST_TIMEOUT, positive

    p = argparse.ArgumentParser(prog="python -m rft.studio", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one; default 8765)")
    p.add_argument("--root", default=os.environ.get("RFT_CHECKPOINT_ROOT_DIR", "./checkpoints"),
                   help="the checkpoint root whose runs and sweeps the studio shows, and where runs it "
                        "launches write (default $RFT_CHECKPOINT_ROOT_DIR or ./checkpoints, as run.py)")
    p.add_argument("--conf", default=str(REPO / "conf"), help="the config groups (default: this repo's conf/)")
    p.add_argument("--token-file", default=None,
                   help=f"a file holding the token (default ${TOKEN_ENV}; without either, a fresh one)")
    # taken only to refuse it with the reason (main), rather than argparse's "unrecognized argument"
    p.add_argument("--token", default=None, help=argparse.SUPPRESS)
    p.add_argument("--request-timeout", type=positive(float), default=REQUEST_TIMEOUT,
                   help=f"seconds a request has to arrive whole, and a client to read on in its answer; a slower one's "
                        f"connection is closed (default {REQUEST_TIMEOUT:g})")
    p.add_argument("--max-connections", type=positive(int), default=MAX_CONNECTIONS,
                   help=f"connections at once; beyond, requests are answered 503 (default {MAX_CONNECTIONS})")
    return p


def _require_studio_extra() -> None:
    """A SystemExit saying how to install the studio's optional packages when one is missing."""
    try:
        import jinja2  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"rft.studio: {e.name} is not installed: the studio is an optional extra. "
                         f"Install it with `pip install -e '.[studio]'` (make test does).")


def _environments(root: Path) -> dict:
    """Set the studio's own environment; returns the one its launched runs get."""
    os.environ.pop(TOKEN_ENV, None)  # nothing the studio starts (a run, the plan's children) needs it
    # launched runs write where the studio reads, whatever directory they run from
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(root)}
    # the live plan loads each change's datasets: offline, a hub dataset that is not downloaded
    # is an error at once rather than a minute of retries; launched runs keep the user's setting
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ["RFT_CHECKPOINT_ROOT_DIR"] = str(root)
    return env


def _serve(app, args, root: Path, token: str) -> None:
    """Bind, print where the studio is (the URL with the token), and serve until stopped."""
    from rft.serving.auth import is_loopback, listening_socket

    sock, host, port = listening_socket(args.host, args.port, "rft.studio")
    if not is_loopback(args.host):
        print(f"rft.studio: WARNING: listening on {args.host}, not loopback: anyone who can reach this port and "
              f"has the token can launch runs, and the traffic is plain HTTP.", file=sys.stderr, flush=True)
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else host
    print(f"rft.studio: runs under {root}", flush=True)
    # the token after '#': the browser keeps it from every request, log and Referer. Quoted, as
    # the page decodes it: a token's '%' stopped the page's script, its '&' cut the token short
    print(f"rft.studio: open http://{shown}:{port}/compose#token={quote(token, safe='')}", flush=True)

    import uvicorn

    from rft.serving.auth import server_config

    config = server_config(app, request_timeout=args.request_timeout, max_connections=args.max_connections,
                           token=token, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    if args.token is not None:
        raise SystemExit(f"rft.studio: --token is refused: a command line is visible to every local user (ps). Put "
                         f"the token in a file only you can read and pass --token-file FILE, or set ${TOKEN_ENV}.")
    _require_studio_extra()
    from rft.studio.app import make_app

    root = Path(os.path.expanduser(args.root)).resolve()
    token = read_token(args.token_file)
    env = _environments(root)
    app = make_app(token, root, Path(args.conf), REPO, launch_env=env, hosts=host_names(args.host))
    _serve(app, args, root, token)


if __name__ == "__main__":
    main()
