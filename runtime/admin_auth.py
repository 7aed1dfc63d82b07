"""The admin token: how the admin API checks it, and where `serve` keeps one it generated.

The admin API changes the cluster (scales pools, drains workers), so it is never open: a call must
carry `authorization: Bearer <token>`, compared in constant time. The token is --admin-token or
SPLITSERVE_ADMIN_TOKEN; it is never logged and never on a child's command line. When none is
configured, `splitserve serve` generates one and writes it to a file only its user can read
(`token_file(port)`: mode 0600 in a 0700 directory), which the CLI reads for a loopback admin URL
on that port, so that `splitserve pools status` just works beside a `splitserve serve` of the same
user, and other users of the machine cannot use it. The file is removed when serve stops.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

BEARER = "bearer "


def token_matches(header: str | None, token: str) -> bool:
    """Whether an `authorization` value carries `token` (as `Bearer <token>`), in constant time."""
    if not header or not header[:len(BEARER)].lower() == BEARER:
        return False
    return hmac.compare_digest(header[len(BEARER):].strip().encode(), token.encode())


def state_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "splitserve"


def token_file(port: int) -> Path:
    return state_dir() / f"admin-{port}.token"


def write_token_file(port: int, token: str) -> Path:
    path = token_file(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return path


def read_token_file(port: int) -> str | None:
    try:
        return token_file(port).read_text().strip() or None
    except OSError:
        return None


def new_token() -> str:
    return secrets.token_urlsafe(32)
