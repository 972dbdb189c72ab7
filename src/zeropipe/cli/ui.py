"""``zeropipe ui [--host H] [--port P] [--runs-dir DIR] [--data-dir DIR] [--db PATH] [--token T] [--allow-remote-code]``: the web UI.

Serves the runs under the runs folder (and any run started from the command line into it),
a form to set up and launch new ones, live charts, logs, stop / resume / export, and the
doctor report. Runs keep going when the UI stops; a restarted UI picks them up again.
Binding an address other than loopback requires a token on every request: one is generated
and printed unless --token gives it.
"""

from __future__ import annotations

import argparse
import os
import sys


def register(commands) -> None:
    parser = commands.add_parser("ui", help="start the web UI (set up, launch, watch, stop, resume and export runs)", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    parser.add_argument("--runs-dir", action="append", default=None, metavar="DIR", help="folder of run directories (default ./runs); repeat for more, the first gets new runs")
    parser.add_argument("--data-dir", action="append", default=None, metavar="DIR", help="folder the UI's configs may read data and models from (default: the current directory); repeatable")
    parser.add_argument("--db", default=os.environ.get("ZEROPIPE_DB"), metavar="PATH", help="run database (SQLite; default RUNS_DIR/.zeropipe/runs.sqlite3, or $ZEROPIPE_DB)")
    parser.add_argument("--token", default=os.environ.get("ZEROPIPE_UI_TOKEN"), help="token every request must carry (default: none on loopback, generated otherwise; or $ZEROPIPE_UI_TOKEN)")
    parser.add_argument(
        "--allow-remote-code", action="store_true",
        help="accept trust_remote_code in configs submitted through the UI (it runs Python code from a model's folder: only for a UI nobody else can reach)",
    )  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from zeropipe.server import create_app
    from zeropipe.server.security import is_loopback, new_token
    from zeropipe.store import Roots, RunStore

    roots = Roots(runs=args.runs_dir or ["runs"], data=args.data_dir or ["."])
    store = RunStore(roots, args.db, allow_remote_code=args.allow_remote_code)
    token = args.token
    if token is None and not is_loopback(args.host):
        token = new_token()
    app = create_app(store, token=token, bind_host=args.host)

    # Bind first so --port 0 can print the real port before serving.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as err:
        from zeropipe.errors import ZeroPipeError

        raise ZeroPipeError(f"cannot listen on {args.host}:{args.port} ({err.strerror}): choose another --port") from None
    port = sock.getsockname()[1]
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown_host}:{port}/" + (f"?token={token}" if token else "")
    print(f"zeropipe ui: {url}", flush=True)
    print(f"  runs: {', '.join(map(str, roots.runs))}  data: {', '.join(map(str, roots.data))}  database: {store.db_path}", file=sys.stderr, flush=True)
    if token and not args.token:
        print("  a token was generated because the server is reachable from other machines: keep the URL private", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        store.close()
    return 0
