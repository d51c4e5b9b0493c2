"""`nanograph serve` as a subprocess on a free loopback port (the default SmolLM2 on the CPU): started, waited for
on /health, stopped with SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import nanograph

MAX_MODEL_LEN = 512
START_SECONDS = 180  # a first run converts the default model (~30 s) before it loads


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def module_server(tmp_path_factory, *args: str):
    """A server for one module (a fixture's body); its teardown stops it with SIGTERM and checks that it exits 0."""
    server = ServerProcess(tmp_path_factory.mktemp("serve") / "server.log", *args)
    yield server
    code = server.stop()
    assert code == 0, f"nanograph serve exited with {code} after SIGTERM:\n{server.log()[-4000:]}"


def server_env(**extra: str) -> dict[str, str]:
    """The environment of a server subprocess: this nanograph first on its path."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(nanograph.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]), **extra)


def serve_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "nanograph.cli", "serve", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
            "--port", str(port), *args]


def engine_processes(pid: int) -> list[int]:
    """The engine processes (multiprocessing's spawned children) of the server with process id pid (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie left."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class ServerProcess:
    def __init__(self, log_path: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True,
                 client: dict | None = None, scheme: str = "http"):
        """client: httpx.Client's settings that reach the server (verify=, cert=, transport= for a Unix socket);
        scheme: https for a server with --ssl-certfile."""
        self.port = free_port()
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"
        self.client = client or {}
        self.log_path = log_path
        with open(log_path, "w") as log:
            # A session of its own: kill_group() ends the server and whatever it started.
            self.process = subprocess.Popen(serve_command(self.port, *args), stdout=log, stderr=subprocess.STDOUT,
                                            env=env or server_env(), start_new_session=True)
        if wait:
            self._wait_healthy()

    def _wait_healthy(self):
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nanograph serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                with httpx.Client(**self.client, timeout=2) as client:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.process.kill()
        raise RuntimeError(f"nanograph serve was not healthy within {START_SECONDS} s:\n{self.log()}")

    def kill_group(self):
        """SIGKILL to the server's process group (the server, its engine process and theirs)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then the exit code (the process is killed, and the code is None, if it outlives timeout)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None
