"""`python -m eagle_infer.server` (or another OpenAI-compatible server, e.g. vLLM's from its own
environment) as a child process on a free local port (benchmarks, tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """The server with `args` on a free port, its output in `log`; `stop()` sends SIGTERM.
    program: the command before `--port PORT args` (default: this Python's eagle_infer.server,
    the repository on PYTHONPATH); another program runs without PYTHONPATH, so that our packages
    never shadow its environment's."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None,
                 program: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        full_env = dict(os.environ)
        if program is None:
            program = [sys.executable, "-m", "eagle_infer.server"]
            paths = (str(REPO), full_env.get("PYTHONPATH", ""))
            full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        else:
            full_env.pop("PYTHONPATH", None)
        full_env.update(env or {})
        cmd = [*program, "--port", str(self.port), *args]
        self.started = time.time()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text()[-chars:] if self.log.is_file() else ""

    def wait_ready(self, timeout: float = 240) -> float:
        """Poll /health until it answers 200 and return the seconds since the process started
        (its start-up: loading, compiling); RuntimeError (with the log's tail) if the server
        exits or is not ready within `timeout` seconds."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); its log:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.time() - self.started
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not ready after {timeout:.0f}s; its log:\n{self.log_tail()}")

    def stop(self, grace: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
