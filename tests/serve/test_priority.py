"""`nanograph serve --scheduling-policy priority`: a request's priority field (vLLM's) orders the waiting requests,
lower values first; on the chat, completions and responses routes."""
import threading
import time

import openai
import pytest

from .server_process import module_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--scheduling-policy", "priority", "--max-num-seqs", "1")


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

    long = client.completions.create(model=model, prompt="Count to a thousand:", max_tokens=150, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
    chunks = iter(long)
    next(chunks)  # running now: the others wait for it
    threads = []
    for name, priority in [("late", 5), ("urgent", -1)]:
        threads.append(threading.Thread(target=ask, args=(name, priority)))
        threads[-1].start()
        time.sleep(0.3)  # each arrives while the long one runs
    assert not finished, "a request ran beside the long one: the test's premise (one sequence at a time) broke"
    for _ in chunks:
        pass
    for thread in threads:
        thread.join(timeout=120)
    assert finished == ["urgent", "late"] and texts == alone


def test_priority_reaches_the_chat_and_responses_routes(client, model):
    messages = [{"role": "user", "content": "Hi"}]
    assert client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                          extra_body={"priority": -3}).choices[0].message.content
    assert client.responses.create(model=model, input="Hi", max_output_tokens=2,
                                   extra_body={"priority": 7}).status == "incomplete"
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body={"priority": "high"})
