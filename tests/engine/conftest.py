"""Tiny random-weight model folders that several engine test modules share, made once per session."""
import pytest

from .tiny_models import make_tiny_chat_model, make_tiny_model


@pytest.fixture(scope="session")
def tiny_chat_folder(tmp_path_factory):
    """A tiny model folder with a tokenizer and a chat template."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    make_tiny_chat_model(folder)
    return folder


@pytest.fixture(scope="session")
def qwen3_tied(tmp_path_factory):
    """(folder, transformers model) of the tiny Qwen3 with tied embeddings."""
    folder = tmp_path_factory.mktemp("qwen3-tied")
    return folder, make_tiny_model(folder, "qwen3-tied")
