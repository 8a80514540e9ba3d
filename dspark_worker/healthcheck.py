"""``python -m dspark_worker.healthcheck [PORT_FILE]``: exit 0 when the worker is ready.

For a container's HEALTHCHECK, which cannot know the addresses the worker was started with. It
reads the port file the worker writes once it is ready (``--port-file``; the path is the
argument, else ``$DSPARK_PORT_FILE``) and asks ``/healthz`` on the metrics address written
there, so the check follows ``--metrics-listen`` wherever it points. A worker without a metrics
listener is checked by connecting to its draft listener (TCP, else the Unix socket): that says
it serves, not that it is ready. Anything else, or no port file yet, is exit 1 with one line on
stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import urllib.error
import urllib.request
from typing import Any, Final

TIMEOUT_S: Final = 2.0
# A wildcard bind answers on loopback, which is where the check runs (inside the container).
_WILDCARD: Final = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return _WILDCARD.get(host, host), int(port)


def _url(host: str, port: int, path: str) -> str:
    return f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"


def _text(body: bytes) -> str:
    return body.decode(errors="replace").strip()


def check(port_file: str) -> tuple[bool, str]:
    """(healthy, what was found)."""
    try:
        with open(port_file, encoding="utf-8") as f:
            ports: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        return False, f"no port file {port_file} yet: the worker is not ready"
    except (OSError, ValueError) as exc:
        return False, f"cannot read the port file {port_file}: {exc}"
    if ports.get("metrics"):
        host, port = _host_port(ports["metrics"])
        url = _url(host, port, "/healthz")
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
                return r.status == 200, f"{url}: {r.status} {_text(r.read(64))}"
        except urllib.error.HTTPError as exc:
            with contextlib.closing(exc):
                return False, f"{url}: {exc.code} {_text(exc.read(64))}"
        except OSError as exc:
            return False, f"{url}: {exc}"
    try:
        if ports.get("listen"):
            where = f"tcp {ports['listen']}"
            socket.create_connection(_host_port(ports["listen"]), timeout=TIMEOUT_S).close()
        elif ports.get("unix"):
            where = f"unix {ports['unix']}"
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(TIMEOUT_S)
                s.connect(ports["unix"])
        else:
            return False, f"{port_file} names no listener"
    except OSError as exc:
        return False, f"{where}: {exc}"
    return True, f"{where}: accepts connections (no metrics listener: readiness not checked)"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    port_file = args[0] if args else os.environ.get("DSPARK_PORT_FILE", "")
    if not port_file or len(args) > 1:
        print("usage: python -m dspark_worker.healthcheck PORT_FILE (or $DSPARK_PORT_FILE)",
              file=sys.stderr)
        return 2
    ok, what = check(port_file)
    print(what, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
