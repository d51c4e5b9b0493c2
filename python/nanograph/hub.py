"""Model and tokenizer folders by name: a local folder, or a Hugging Face Hub id fetched into the Hub cache.

A folder that exists always wins. A Hub id goes through huggingface_hub's snapshot_download, with its cache
(HF_HOME, HF_HUB_CACHE, or download_dir), HF_HUB_OFFLINE and HF_TOKEN, and fetches only what nanograph reads:
config.json, generation_config.json, the tokenizer files, the safetensors weights (the shards the index names,
else the top-level *.safetensors), and an embedding model's sentence-transformers pooling (modules.json and the
config.json of the Pooling module it names)."""
from __future__ import annotations

import json
import re
from pathlib import Path

CONFIG_FILES = ["config.json", "generation_config.json", "model.safetensors.index.json", "modules.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json"]
_REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_SUBFOLDERS = ["*/*"]  # a repository's other formats (onnx/, original/, ...) are never fetched


def model_folder(name: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The folder holding the model's config, tokenizer and weights."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    folder = _snapshot(name, revision, download_dir, CONFIG_FILES + TOKENIZER_FILES)
    index = Path(folder) / "model.safetensors.index.json"
    weights = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["*.safetensors"]
    # The first call pinned the commit: the weights come from the same one.
    pooling = pooling_config_files(Path(folder))
    if pooling:  # in a subfolder, which the other calls never fetch
        _snapshot(name, Path(folder).name, download_dir, pooling, ignore=())
    return _snapshot(name, Path(folder).name, download_dir, weights)


def sentence_transformers_modules(folder: Path) -> list[dict]:
    """The modules a folder's sentence-transformers modules.json lists (each with its type and path); [] without
    one."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    return [module for module in modules if isinstance(module, dict)] if isinstance(modules, list) else []


def pooling_config_files(folder: Path) -> list[str]:
    """The config.json of each sentence-transformers Pooling module that the folder's modules.json names."""
    return [f"{module['path']}/config.json" for module in sentence_transformers_modules(folder)
            if str(module.get("type", "")).endswith(".Pooling") and module.get("path")]


def tokenizer_folder(name: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The folder holding a tokenizer (and no weights)."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    return _snapshot(name, revision, download_dir, TOKENIZER_FILES)


def _snapshot(name: str, revision: str | None, download_dir: str | None, patterns: list[str],
              ignore: list[str] | tuple = tuple(_SUBFOLDERS)) -> str:
    """The Hub snapshot of name (a repository id) holding the files that match patterns."""
    if not _REPO_ID.fullmatch(name) or name.startswith(".") or Path(name).exists():
        raise FileNotFoundError(f"model folder {name!r} does not exist, nor is it a Hub id; pass a Hugging Face "
                                "model folder (holding config.json and *.safetensors) or a Hub id such as "
                                "'Qwen/Qwen3-0.6B'")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(name, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
                                 ignore_patterns=list(ignore) or None)
    except LocalEntryNotFoundError:
        cache = download_dir or constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(
                f"{name!r}{at} is neither a local folder nor in the Hugging Face cache ({cache}), and HF_HUB_OFFLINE "
                f"forbids downloading it: download it once with network access (unset HF_HUB_OFFLINE), point "
                f"HF_HUB_CACHE (or download_dir) at a cache that holds it, or pass a local folder") from None
        raise FileNotFoundError(f"{name!r}{at} is neither a local folder nor in the Hugging Face cache ({cache}), "
                                "and the Hub could not be reached to download it: check the network, or pass a "
                                "local folder") from None
    except GatedRepoError:
        raise PermissionError(f"{name!r} is a gated repository: accept its terms on huggingface.co and set HF_TOKEN "
                              "(or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{name!r} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{name!r} is neither a local folder nor a model on the Hugging Face Hub (a private "
                                "one needs HF_TOKEN)") from None
