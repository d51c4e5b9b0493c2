"""vLLM's development routes for sleep mode on `nanograph serve --enable-sleep-mode` with NANOGRAPH_SERVER_DEV_MODE=1
(the default model on the CPU): POST /sleep, /wake_up and GET /is_sleeping through a sleep at each level, requests
refused with a 503 while asleep, the same completions after, and the routes' errors."""
import concurrent.futures
import time

import httpx
import openai
import pytest

from .server_process import ServerProcess, server_env

PROMPT = "Answer in one word, as a geography teacher would to a class of ten year olds: the capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("serve") / "server.log", "--enable-sleep-mode",
                           env=server_env(NANOGRAPH_SERVER_DEV_MODE="1"))
    yield server
    assert server.stop() == 0, server.log()[-4000:]


def is_sleeping(server) -> bool:
    response = httpx.get(server.base_url + "/is_sleeping", timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["is_sleeping"]


def complete(client, model) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text


def test_vllms_level_2_order_with_collective_rpc(server, client, model):
    expected = complete(client, model)
    assert httpx.post(server.base_url + "/sleep", params={"level": 2}, timeout=60).status_code == 200
    assert httpx.post(server.base_url + "/wake_up", params={"tags": "weights"}, timeout=120).status_code == 200
    response = httpx.post(server.base_url + "/collective_rpc", json={"method": "reload_weights"}, timeout=120)
    assert response.status_code == 200 and response.json() == {"results": [None]}, response.text
    assert httpx.post(server.base_url + "/wake_up", params={"tags": "kv_cache"}, timeout=120).status_code == 200
    assert complete(client, model) == expected
    response = httpx.post(server.base_url + "/collective_rpc", json={"method": "update_weights"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "method", response.text
    response = httpx.post(server.base_url + "/collective_rpc", content=b"[1, 2", timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json", response.text
    response = httpx.post(server.base_url + "/collective_rpc", json={"method": "reload_weights", "kwargs": {"a": 1}},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "kwargs", response.text
    assert httpx.post(server.base_url + "/sleep", params={"level": 2}, timeout=60).status_code == 200
    response = httpx.post(server.base_url + "/collective_rpc", json={"method": "reload_weights"}, timeout=60)
    assert response.status_code == 409 and "wake them first" in response.json()["error"]["message"], response.text
    assert httpx.post(server.base_url + "/wake_up", timeout=120).status_code == 200


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_and_a_wake_up_between_completions(server, client, model, level):
    expected = complete(client, model)
    assert not is_sleeping(server)
    assert httpx.post(server.base_url + "/sleep", params={"level": level}, timeout=60).status_code == 200
    assert is_sleeping(server)
    with pytest.raises(openai.APIStatusError) as refused:
        complete(client, model)
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "engine_sleeping" and "wake_up" in refused.value.body["message"]
    # The weights first, then the KV cache over them: asleep until both are back.
    assert httpx.post(server.base_url + "/wake_up", params={"tags": "weights"}, timeout=120).status_code == 200
    assert is_sleeping(server)
    assert httpx.post(server.base_url + "/wake_up", params={"tags": "kv_cache"}, timeout=120).status_code == 200
    assert not is_sleeping(server)
    assert complete(client, model) == expected


def test_the_routes_errors(server, client, model):
    for level in ("0", "3", "one"):
        response = httpx.post(server.base_url + "/sleep", params={"level": level}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "level", response.text
    response = httpx.post(server.base_url + "/sleep", params={"level": 2}, timeout=60)
    assert response.status_code == 200
    response = httpx.post(server.base_url + "/wake_up", params={"tags": ["kv_cache", "cache"]}, timeout=60)
    assert response.status_code == 400 and "'weights', 'kv_cache'" in response.json()["error"]["message"]
    assert httpx.post(server.base_url + "/wake_up", timeout=120).status_code == 200
    assert not is_sleeping(server)
    for query, param in (({"mode": "keep"}, "mode"), ({"tags": "cache"}, "tags")):
        response = httpx.post(server.base_url + "/sleep", params=query, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert not is_sleeping(server)


def test_a_sleep_while_a_request_runs_aborts_it_by_default(server, client, model):
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=100, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    assert httpx.post(server.base_url + "/sleep", timeout=120).status_code == 200
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "abort"
    assert is_sleeping(server)
    assert httpx.post(server.base_url + "/wake_up", timeout=120).status_code == 200


def test_a_sleep_that_waits_lets_running_requests_stream_to_their_end(server, client, model):
    """?mode=wait: the engine steps on, its streams flowing, while it refuses new requests; /sleep answers once the
    running ones have finished."""
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=100, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sleeping = pool.submit(httpx.post, server.base_url + "/sleep", params={"mode": "wait"}, timeout=120)
        time.sleep(0.5)
        with pytest.raises(openai.APIStatusError, match="going to sleep") as refused:
            complete(client, model)
        assert refused.value.status_code == 503
        assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
        assert sleeping.result().status_code == 200
    assert is_sleeping(server)
    assert httpx.post(server.base_url + "/wake_up", timeout=120).status_code == 200
