"""Test helper: a real `splitserve serve` cluster in a subprocess, with its own Redis.

The Redis is started here (runtime.redis_embedded) and passed as --redis-url so that tests can
look the workers up, query their status over gRPC and find their pids to kill them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import redis.asyncio as aioredis

from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.discovery import WorkerInfo, list_workers
from runtime.redis_embedded import EmbeddedRedis, free_port


class ServeCluster:
    def __init__(self, *args: str, env: dict | None = None, timeout_s: float = 180.0) -> None:
        self.redis = EmbeddedRedis()
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        cmd = [sys.executable, "-m", "splitserve", "serve", "--http-port", str(self.http_port),
               "--grpc-port", str(self.grpc_port), "--redis-url", self.redis.url, "--lease-ttl-s", "2", *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            self.output.append(line)
            if "Splitserve is ready" in line:
                break
            if time.monotonic() > deadline:
                break
        if self.proc.poll() is not None or not any("is ready" in l for l in self.output):
            self.stop()
            raise RuntimeError("cluster did not start:\n" + "".join(self.output[-40:]))
        # keep draining output so the pipe never fills
        import threading
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def workers(self) -> list[WorkerInfo]:
        async def go():
            r = aioredis.Redis.from_url(self.redis.url)
            try:
                return await list_workers(r, "splitserve")
            finally:
                await r.aclose()
        return asyncio.run(go())

    def status(self, worker: WorkerInfo) -> worker_pb2.WorkerStatus:
        with grpc.insecure_channel(worker.address) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.WorkerStatusRequest(), timeout=5)

    def wait_idle(self, timeout_s: float = 30.0) -> list[worker_pb2.WorkerStatus]:
        """Every live worker has all blocks free and nothing running or waiting."""
        deadline = time.monotonic() + timeout_s
        while True:
            statuses = [self.status(w) for w in self.workers()]
            if all(s.num_free_blocks == s.num_total_blocks and s.num_running == 0 and s.num_waiting == 0
                   for s in statuses):
                return statuses
            if time.monotonic() > deadline:
                raise AssertionError(f"workers not idle: {statuses}")
            time.sleep(0.2)

    def child_pids(self, match: str) -> list[int]:
        """Pids of the launcher's children whose command line contains `match`."""
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and match in cmdline:
                out.append(int(pid))
        return out

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.redis.close()
        return self.proc.returncode

    def __enter__(self) -> "ServeCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
