"""Default sampling parameters from a model's generation_config.json, taken as vLLM takes them."""
from __future__ import annotations

from pathlib import Path

# generation_config.json's names -> SamplingParams'. vLLM takes these and nothing else (do_sample is not read:
# temperature decides).
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(folder: str | None) -> dict:
    """SamplingParams fields the folder's generation_config.json sets (those it leaves at transformers' defaults
    are left out); {} for None (generation_config="vllm") or a folder without the file."""
    if folder is None or not (Path(folder) / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    given = GenerationConfig.from_pretrained(folder).to_diff_dict()
    return {ours: given[theirs] for theirs, ours in _SAMPLING_FIELDS.items() if given.get(theirs) is not None}
