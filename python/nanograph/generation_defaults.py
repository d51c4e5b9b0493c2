"""Default sampling parameters from a model's generation_config.json, taken as vLLM takes them."""
from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger("nanograph")

# generation_config.json's names -> SamplingParams'. vLLM takes these and nothing else (do_sample is not read:
# temperature decides).
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(folder: str | None, overrides: dict | None = None) -> dict:
    """SamplingParams fields the folder's generation_config.json sets (those it leaves at transformers' defaults
    are left out; none for folder None, generation_config="vllm", or a folder without the file), with overrides
    (Config.override_generation_config, in generation_config.json's names; check_overrides checks them) over
    them."""
    given = {}
    if folder is not None and (Path(folder) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        given = GenerationConfig.from_pretrained(folder).to_diff_dict()
    if overrides:
        unread = sorted(set(overrides) - set(_SAMPLING_FIELDS))
        if unread:
            logger.warning("override_generation_config: %s not read (nanograph takes %s, as vLLM does)",
                           ", ".join(unread), ", ".join(_SAMPLING_FIELDS))
        given = {**given, **overrides}
    return {ours: given[theirs] for theirs, ours in _SAMPLING_FIELDS.items() if given.get(theirs) is not None}


def check_overrides(overrides: dict):
    """Raises ValueError naming override_generation_config and the field, in generation_config.json's names, where
    the values make no valid SamplingParams (checked before the model loads)."""
    from .sampling_params import SamplingParams

    given = {ours: overrides[theirs] for theirs, ours in _SAMPLING_FIELDS.items() if overrides.get(theirs) is not None}
    try:
        SamplingParams(**given)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        for theirs, ours in _SAMPLING_FIELDS.items():
            if theirs != ours:
                message = re.sub(rf"\b{ours}\b", theirs, message)
        raise ValueError(f"override_generation_config: {message}") from None
