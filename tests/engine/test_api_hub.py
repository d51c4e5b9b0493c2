"""Hugging Face Hub ids: LLM("org/name") loads from a Hub cache laid out on disk as huggingface_hub writes it
(models--org--name/blobs, snapshots/<commit>, refs/<branch>), offline; revisions, download_dir, a local folder that
wins, a separate tokenizer id, and the error for an id that is not there. No test reaches the network."""
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

import nanograph.hub
from nanograph import LLM, SamplingParams
from nanograph.hub import model_folder

from .tiny_models import TOKENIZER_FILES, make_tiny_chat_model

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPT = "The sky is"
ENGINE = dict(device="cpu", max_model_len=64, num_kv_blocks=16, block_size=16)


def put_in_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str, refs=("main",)) -> Path:
    """folder's files as one snapshot of repo_id in a Hub cache: contents in blobs/, linked from the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny chat models that generate differently, as local folders."""
    folders = []
    for seed in (0, 1):
        folder = tmp_path_factory.mktemp(f"tiny-{seed}")
        make_tiny_chat_model(folder, seed=seed)
        folders.append(folder)
    return folders


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hub cache, set as HF_HUB_CACHE, with HF_HUB_OFFLINE on (as huggingface_hub reads them)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def greedy_ids(llm) -> list[int]:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def reference(models):
    """Each local folder's greedy output."""
    return [greedy_ids(LLM(str(folder), **ENGINE)) for folder in models]


def test_a_hub_id_loads_from_the_cache_offline(models, reference, offline_cache):
    snapshot = put_in_hub_cache(offline_cache, "tiny-org/tiny-chat", models[0], "a" * 40)
    llm = LLM("tiny-org/tiny-chat", **ENGINE)
    assert llm.engine.config.model == str(snapshot)
    assert greedy_ids(llm) == reference[0]
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text  # its tokenizer came along


def test_revision_picks_a_branch_or_a_commit(models, reference, offline_cache):
    put_in_hub_cache(offline_cache, "tiny-org/tiny-chat", models[0], "a" * 40)
    put_in_hub_cache(offline_cache, "tiny-org/tiny-chat", models[1], "b" * 40, refs=("v2",))
    assert greedy_ids(LLM("tiny-org/tiny-chat", **ENGINE)) == reference[0]  # main
    assert greedy_ids(LLM("tiny-org/tiny-chat", revision="v2", **ENGINE)) == reference[1]
    assert greedy_ids(LLM("tiny-org/tiny-chat", revision="b" * 40, **ENGINE)) == reference[1]
    with pytest.raises(FileNotFoundError, match="'tiny-org/tiny-chat' at revision 'v3' is neither a local folder nor "
                                                "in the Hugging Face cache"):
        LLM("tiny-org/tiny-chat", revision="v3", **ENGINE)


def test_download_dir_is_the_cache(models, reference, tmp_path, offline_cache):
    own_cache = tmp_path / "own"
    put_in_hub_cache(own_cache, "tiny-org/tiny-chat", models[1], "c" * 40)
    assert greedy_ids(LLM("tiny-org/tiny-chat", download_dir=str(own_cache), **ENGINE)) == reference[1]


def test_a_local_folder_wins_over_the_cache(models, reference, tmp_path, offline_cache, monkeypatch):
    put_in_hub_cache(offline_cache, "tiny-org/tiny-chat", models[0], "a" * 40)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(models[1], tmp_path / "tiny-org" / "tiny-chat")
    assert greedy_ids(LLM("tiny-org/tiny-chat", **ENGINE)) == reference[1]


def test_a_separate_tokenizer_by_hub_id(models, reference, tmp_path, offline_cache):
    weights_only = tmp_path / "weights-only"
    shutil.copytree(models[0], weights_only, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer_only.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(models[0] / name, tokenizer_only / name)
    snapshot = put_in_hub_cache(offline_cache, "tiny-org/tokenizer", tokenizer_only, "d" * 40)
    assert LLM(str(weights_only), **ENGINE).get_tokenizer() is None
    llm = LLM(str(weights_only), tokenizer="tiny-org/tokenizer", **ENGINE)
    assert llm.engine.config.tokenizer == str(snapshot)
    assert greedy_ids(llm) == reference[0]


def test_an_id_that_is_nowhere_says_what_to_do(offline_cache):
    with pytest.raises(FileNotFoundError) as info:
        LLM("tiny-org/not-there", **ENGINE)
    message = str(info.value)
    assert "'tiny-org/not-there' is neither a local folder nor in the Hugging Face cache" in message
    assert str(offline_cache) in message and "HF_HUB_OFFLINE" in message and "pass a local folder" in message
    with pytest.raises(FileNotFoundError, match="model folder '/no/such/folder' does not exist, nor is it a Hub id"):
        LLM("/no/such/folder", **ENGINE)


def test_only_the_files_nanograph_reads_are_fetched(models, tmp_path, monkeypatch):
    """snapshot_download is given a repository of many formats (a fake Hub that applies the patterns as the real one
    does): config, generation config, tokenizer, the index's shards and the sentence-transformers pooling config
    come; other weights and folders do not."""
    repo = tmp_path / "repo"
    shutil.copytree(models[0], repo)
    (repo / "model.safetensors").rename(repo / "model-00001-of-00001.safetensors")
    (repo / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}')
    for extra in ("consolidated.safetensors", "pytorch_model.bin", "README.md", "onnx/model.safetensors",
                  "original/params.json", "1_Pooling/other.json", "2_Normalize/config.json"):
        (repo / extra).parent.mkdir(exist_ok=True)
        (repo / extra).write_text("not read")
    # An embedding model's sentence-transformers modules: its Pooling module's config comes, from its subfolder.
    (repo / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}, '
        '{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}, '
        '{"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]')
    (repo / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    listing = [str(path.relative_to(repo)) for path in repo.rglob("*") if path.is_file()]
    fetched = tmp_path / "snapshot"

    def hub_snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, ignore_patterns=None):
        for name in filter_repo_objects(listing, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (fetched / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / name, fetched / name)
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_snapshot_download)
    assert model_folder("tiny-org/many-formats") == str(fetched)
    assert sorted(str(path.relative_to(fetched)) for path in fetched.rglob("*") if path.is_file()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors",
         "modules.json", "1_Pooling/config.json", *TOKENIZER_FILES])


def test_the_environment_variables_are_honoured(models, tmp_path):
    """HF_HUB_CACHE and HF_HUB_OFFLINE as a user sets them, in a fresh process (huggingface_hub reads them at
    import)."""
    snapshot = put_in_hub_cache(tmp_path / "hub", "tiny-org/tiny-chat", models[0], "e" * 40)
    # hub.py alone (not the package, which imports torch): a fresh interpreter starts in a second.
    script = ("import importlib.util, sys; "
              f"spec = importlib.util.spec_from_file_location('hub', {str(Path(nanograph.hub.__file__))!r}); "
              "hub = importlib.util.module_from_spec(spec); spec.loader.exec_module(hub); "
              "print(hub.model_folder('tiny-org/tiny-chat')); hub.model_folder('tiny-org/not-there')")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == str(snapshot)
    assert "'tiny-org/not-there' is neither a local folder nor in the Hugging Face cache" in result.stderr
    assert "HF_HUB_OFFLINE forbids downloading it" in result.stderr
