"""A real `nmt serve` process on a free loopback port, and HTTP helpers around it: what the
serve tests (tests/serve/) speak to, never an app in process."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

from helpers.cli import NMT_CLI


def free_port() -> int:
    """A loopback TCP port free now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A running `nmt serve` and small HTTP helpers around it."""

    def __init__(self, *args: object) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = NMT_CLI.popen("serve", "--port", self.port, "--precision", "fp32",
                                  *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(self.proc.stderr.read().decode())  # type: ignore[union-attr]
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("server did not come up")

    def request(self, path: str, body: bytes | None = None, content_type: str | None = None,
                method: str | None = None, headers: dict[str, str] | None = None
                ) -> tuple[int, Any, Any]:
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={**({"Content-Type": content_type}
                                                 if content_type else {}), **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read()), resp.headers
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read()), err.headers  # case-insensitive

    def raw(self, path: str) -> tuple[int, Any, bytes]:
        """GET `path` as bytes, any content type: (status, headers, body)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=120) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers, err.read()

    def get(self, path: str) -> tuple[int, Any, Any]:
        return self.request(path)

    def post(self, path: str, payload: dict[str, Any], **kwargs: Any
             ) -> tuple[int, Any, Any]:
        return self.request(path, json.dumps(payload).encode(), "application/json", **kwargs)

    def form(self, path: str, fields: list[tuple[str, str]]) -> tuple[int, Any, dict]:
        from urllib.parse import urlencode

        return self.request(path, urlencode(fields).encode(),
                            "application/x-www-form-urlencoded")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
