"""python -m rft.studio [--host 127.0.0.1] [--port 8765] [--root ./checkpoints]

Serves the studio on loopback with a fresh token in the printed URL; --host to share it
deliberately (plain HTTP: anyone who can reach the port and has the token can launch runs).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKEN_ENV = "RFT_STUDIO_TOKEN"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m rft.studio", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one; default 8765)")
    p.add_argument("--root", default=os.environ.get("RFT_CHECKPOINT_ROOT_DIR", "./checkpoints"),
                   help="the checkpoint root whose runs and sweeps the studio shows, and where runs it "
                        "launches write (default $RFT_CHECKPOINT_ROOT_DIR or ./checkpoints, as run.py)")
    p.add_argument("--conf", default=str(REPO / "conf"), help="the config groups (default: this repo's conf/)")
    p.add_argument("--token", default=None, help=f"the token (default ${TOKEN_ENV}; without either, a fresh one)")
    args = p.parse_args(argv)

    try:
        import jinja2  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"rft.studio: {e.name} is not installed: the studio is an optional extra. "
                         f"Install it with `pip install -e '.[studio]'` (make test does).")
    from rft.reward_server import _is_loopback, listening_socket
    from rft.studio.app import make_app

    root = Path(os.path.expanduser(args.root)).resolve()
    token = args.token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    # launched runs write where the studio reads, whatever directory they run from
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(root)}
    # the live plan loads each change's datasets: offline, a hub dataset that is not downloaded
    # is an error at once rather than a minute of retries; launched runs keep the user's setting
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ["RFT_CHECKPOINT_ROOT_DIR"] = str(root)
    app = make_app(token, root, Path(args.conf), REPO, launch_env=env)

    sock, host, port = listening_socket(args.host, args.port, "rft.studio")
    if not _is_loopback(args.host):
        print(f"rft.studio: WARNING: listening on {args.host}, not loopback: anyone who can reach this port and "
              f"has the token can launch runs, and the traffic is plain HTTP.", file=sys.stderr, flush=True)
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else host
    print(f"rft.studio: runs under {root}", flush=True)
    print(f"rft.studio: open http://{shown}:{port}/compose?token={token}", flush=True)

    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
