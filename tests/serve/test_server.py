"""Stopping under load: SIGINT (SIGTERM is every module's teardown) ends the running streams with "abort" and
[DONE], stops accepting connections, and the process exits 0 soon after. A port in use fails before the model loads;
SIGTERM while the engine loads ends the engine process too; an engine that dies stops the server (exit 1), or with
VLLM_KEEP_ALIVE_ON_ENGINE_DEATH leaves it answering 503."""
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from nanograph.default_model import default_model_path

from .server_process import ServerProcess, engine_processes, process_gone, serve_command, server_env


def test_sigint_aborts_running_streams_and_exits_0(tmp_path):
    server = ServerProcess(tmp_path / "server.log")
    body = {"prompt": "Count with me: one, two,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    num_streams = 3
    ready = set()  # the streams that have had two chunks (or ended before)

    def stream_ready(index: int):
        """Exactly one SIGINT, once every stream is ready: a second one is uvicorn's force quit, which cuts open
        responses."""
        if index not in ready:
            ready.add(index)
            if len(ready) == num_streams:
                server.process.send_signal(signal.SIGINT)

    async def stream_until_stopped(http: httpx.AsyncClient, index: int) -> tuple[list, bool]:
        chunks, done = [], False
        try:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line:
                        chunks.append(json.loads(line.removeprefix("data: ")))
                        if len(chunks) == 2:
                            stream_ready(index)
        finally:
            stream_ready(index)  # one that ended early must not hold the others back until they end
        return chunks, done

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            return await asyncio.gather(*(stream_until_stopped(http, index) for index in range(num_streams)))

    start = time.monotonic()
    try:
        results = asyncio.run(main())
        code = server.process.wait(timeout=20)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert code == 0, server.log()[-3000:]
    assert time.monotonic() - start < 20
    for chunks, done in results:
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert len(chunks) < 400
    try:
        httpx.get(server.base_url + "/health", timeout=2)
        raise AssertionError("the stopped server still accepts connections")
    except httpx.ConnectError:
        pass


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.1)


def test_a_port_in_use_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(serve_command(port), capture_output=True, text=True, timeout=120, env=server_env())
    assert result.returncode == 1, result.stderr
    assert f"nanograph serve: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "KV cache" not in result.stderr and "listening" not in result.stderr


def test_sigterm_while_the_engine_loads_ends_the_engine_process(tmp_path):
    """The weights are a named pipe nobody writes: the engine process waits in its load until the server, sent
    SIGTERM, ends it and exits 143."""
    folder = tmp_path / "model"
    folder.mkdir()
    for path in Path(default_model_path()).iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    fifo = folder / "model.safetensors"
    os.mkfifo(fifo)
    server = ServerProcess(tmp_path / "server.log", str(folder), wait=False)
    try:
        wait_for(lambda: engine_processes(server.process.pid), 60, "the engine process starts")
        engines = engine_processes(server.process.pid)
        time.sleep(1)  # into its load, where it stays
        assert server.process.poll() is None, server.log()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=30)
        assert code == 128 + signal.SIGTERM, server.log()
        assert "stopped while the engine was starting" in server.log()
        # Ended by the server, before it exited: not left to multiprocessing's exit handler.
        assert all(process_gone(pid) for pid in engines)
    finally:
        server.kill_group()
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))  # a reader still blocked on the pipe goes on


def test_the_server_stops_with_exit_1_when_its_engine_dies(tmp_path):
    server = ServerProcess(tmp_path / "server.log")
    try:
        (engine,) = engine_processes(server.process.pid)
        os.kill(engine, signal.SIGKILL)
        code = server.process.wait(timeout=30)
    finally:
        server.kill_group()
    log = server.log()
    assert code == 1, log[-3000:]
    assert "the engine process exited (signal SIGKILL)" in log and "stopping the server" in log


def test_keep_alive_on_engine_death_answers_503_until_stopped(tmp_path):
    server = ServerProcess(tmp_path / "server.log", env=server_env(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH="1"))
    try:
        (engine,) = engine_processes(server.process.pid)
        os.kill(engine, signal.SIGKILL)
        wait_for(lambda: httpx.get(server.base_url + "/health", timeout=5).status_code == 503, 30,
                 "/health answers 503")
        response = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert response.status_code == 503 and "engine process exited" in response.json()["error"]["message"]
        time.sleep(1)
        assert server.process.poll() is None
        code = server.stop()
    finally:
        server.kill_group()
    assert code == 0, server.log()[-3000:]
    assert "the engine process exited (signal SIGKILL)" in server.log()
