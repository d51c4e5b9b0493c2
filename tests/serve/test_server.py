"""Stopping under load: SIGINT (SIGTERM is every module's teardown) ends the running streams with "abort" and
[DONE], stops accepting connections, and the process exits 0 soon after."""
import asyncio
import json
import signal
import time

import httpx

from .server_process import ServerProcess


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
