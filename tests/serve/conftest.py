"""Fixtures for the server tests: a module's own `nanograph serve` subprocess, the official OpenAI client on it,
and an in-process LLM on the same model and device for reference outputs."""
import openai
import pytest
from transformers import AutoTokenizer

from nanograph import LLM
from nanograph.default_model import default_model_path

from .server_process import MAX_MODEL_LEN, module_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="session")
def reference_llm():
    """The same model, device and max_model_len as the servers."""
    return LLM(device="cpu", max_model_len=MAX_MODEL_LEN)
