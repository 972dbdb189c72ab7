"""``zeropipe ui [--host H] [--port P] [--runs-dir DIR] [--data-dir DIR] [--db PATH] [--token T] [--allow-remote-code] [--trust-multinode]``: the web UI.

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
from pathlib import Path


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
    parser.add_argument(
        "--trust-multinode", action="store_true",
        help="accept hardware.nodes, hostfile, ssh_options, ssh_port, launcher and master_addr in configs submitted through the UI: "
        "whoever reaches the UI may then start commands on those machines over ssh with this user's keys (ssh options still pass "
        "only an allow-list: never ProxyCommand, LocalCommand, -F or -J). Only for a UI nobody else can reach",
    )  # fmt: skip
    parser.set_defaults(run=run)


def shown_hosts(host: str) -> list[str]:
    """The addresses to print for a bind address: a wildcard (0.0.0.0, ::) is this machine's addresses, loopback last."""
    if host not in ("0.0.0.0", "::", ""):
        return [host]
    import ipaddress
    import socket

    import psutil

    families = (socket.AF_INET, socket.AF_INET6) if host == "::" else (socket.AF_INET,)
    found = []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family not in families:
                continue
            ip = ipaddress.ip_address(address.address.split("%")[0])
            if not ip.is_link_local and not ip.is_unspecified:
                found.append(ip)
    found = sorted(set(found), key=lambda ip: (ip.is_loopback, ip.version, int(ip)))
    return [str(ip) for ip in found] or [socket.gethostname()]


def data_root_notes(data: list[Path], given: bool) -> list[str]:
    """What the start-up lines say of the data folders: which one was taken by default, and a warning for a home folder (or a folder above it)."""
    home = Path.home().resolve()
    notes = [] if given else [f"data: {data[0]} is the folder the UI was started in (no --data-dir): configs sent to the UI may read any file under it"]
    for root in data:
        if root == home or home.is_relative_to(root):
            what = "your home folder" if root == home else f"a folder holding your home folder ({home})"
            notes.append(f"warning: the data folder {root} is {what}: every config sent to the UI may read the files under it "
                         "(hidden files and folders such as ~/.ssh are skipped); start the UI with --data-dir naming the folder of your data")  # fmt: skip
    return notes


def run(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from zeropipe.errors import ZeroPipeError
    from zeropipe.server import create_app
    from zeropipe.server.security import is_loopback, new_token
    from zeropipe.store import Roots, RunStore

    if args.token is not None and not args.token.strip():
        # An empty token matches nothing a browser or script can send: the server would answer 401 to everything.
        raise ZeroPipeError(
            "the token is empty (--token or $ZEROPIPE_UI_TOKEN): no request could ever carry it. Give a hard-to-guess token, "
            "or leave both out to have one generated when the server is reachable from other machines"
        )
    roots = Roots(runs=args.runs_dir or ["runs"], data=args.data_dir or ["."])
    store = RunStore(roots, args.db, allow_remote_code=args.allow_remote_code, trust_multinode=args.trust_multinode)
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
        raise ZeroPipeError(f"cannot listen on {args.host}:{args.port} ({err.strerror}): choose another --port") from None
    port = sock.getsockname()[1]
    urls = [f"http://{f'[{host}]' if ':' in host else host}:{port}/" + (f"?token={token}" if token else "") for host in shown_hosts(args.host)]
    print(f"zeropipe ui: {urls[0]}", flush=True)
    if len(urls) > 1:
        print(f"  also at: {'  '.join(urls[1:])}", file=sys.stderr, flush=True)
    print(f"  runs: {', '.join(map(str, roots.runs))}  data: {', '.join(map(str, roots.data))}  database: {store.db_path}", file=sys.stderr, flush=True)
    for line in data_root_notes(roots.data, given=bool(args.data_dir)):
        print(f"  {line}", file=sys.stderr, flush=True)
    if args.allow_remote_code:
        print("  --allow-remote-code: configs sent from the UI may set trust_remote_code (Python code from model folders runs here)", file=sys.stderr, flush=True)
    if args.trust_multinode:
        print("  --trust-multinode: configs sent from the UI may name other machines (started over ssh with this user's keys)", file=sys.stderr, flush=True)
    if token and not args.token:
        print("  a token was generated because the server is reachable from other machines: keep the URL private", file=sys.stderr, flush=True)
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.stopping.set()  # open event streams end now instead of holding the shutdown
            super().handle_exit(sig, frame)

    # timeout_graceful_shutdown: whatever request still runs 1 s after Ctrl-C (a doctor report,
    # a preview) is cancelled; runs are separate processes and go on.
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1)
    server = Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn raises the Ctrl-C again once it has stopped: it is how the UI is meant to stop
    finally:
        store.close()
    # Everything is saved and closed by now. The interpreter's own teardown (freeing torch,
    # transformers and the rest module by module) would take seconds more, 5-7 s on a busy
    # machine, while the terminal waits: skip it.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
