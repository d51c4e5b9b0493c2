"""`nanograph serve --scheduling-policy priority`: a request's priority field (vLLM's) orders the waiting requests,
lower values first; on the chat, completions and responses routes."""
import re
import threading
import time

import httpx
import openai
import pytest

from .server_process import module_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--scheduling-policy", "priority", "--max-num-seqs", "1")


@pytest.fixture(scope="module")
def client(server):
    """Requests wait behind another here: up to 180 s each on a busy 2-core machine."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=180) as client:
        yield client


def test_waiting_requests_run_in_priority_order(client, model):
    """One sequence at a time: while a long request runs (its first tokens streamed), a request of priority 5 and
    then one of priority -1 arrive; the second runs first. Each gets the text it gets alone."""
    alone = {name: client.completions.create(model=model, prompt=f"Count to ten in {name}:", max_tokens=8,
                                             temperature=0).choices[0].text for name in ("late", "urgent")}
    finished: list[str] = []
    texts: dict[str, str] = {}

    def ask(name: str, priority: int):
        texts[name] = client.completions.create(model=model, prompt=f"Count to ten in {name}:", max_tokens=8,
                                                temperature=0, extra_body={"priority": priority}).choices[0].text
        finished.append(name)

    long = client.completions.create(model=model, prompt="Count to a thousand:", max_tokens=200, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
    chunks = iter(long)
    next(chunks)  # running now: the others wait for it
    threads = []
    for waiting, (name, priority) in enumerate([("late", 5), ("urgent", -1)], start=1):
        threads.append(threading.Thread(target=ask, args=(name, priority)))
        threads[-1].start()
        wait_for_waiting(client, waiting)  # each is queued while the long one runs, the late one first
    assert not finished, "a request ran beside the long one: the test's premise (one sequence at a time) broke"
    for _ in chunks:
        pass
    for thread in threads:
        thread.join(timeout=200)
    assert finished == ["urgent", "late"] and texts == alone


def wait_for_waiting(client, count: int, seconds: float = 60):
    """Until the server's metrics show count requests waiting."""
    line = re.compile(r"^nanograph:num_requests_waiting\{[^}]*\} (\S+)$", re.MULTILINE)
    deadline = time.time() + seconds
    while time.time() < deadline:
        found = line.search(httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text)
        if found and float(found.group(1)) == count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} requests never waited at once: the test's premise broke")


def test_priority_reaches_the_chat_and_responses_routes(client, model):
    messages = [{"role": "user", "content": "Hi"}]
    assert client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                          extra_body={"priority": -3}).choices[0].message.content
    assert client.responses.create(model=model, input="Hi", max_output_tokens=2,
                                   extra_body={"priority": 7}).status == "incomplete"
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body={"priority": "high"})
