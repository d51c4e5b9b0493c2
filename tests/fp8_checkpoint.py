"""make_fp8_checkpoint: a model folder converted to Hugging Face's fine-grained FP8 format, as transformers'
FineGrainedFP8Config saves it: config.json's quantization_config, every linear's weight in float8_e4m3fn with a
float32 `weight_scale_inv` per 128 x 128 block (the multiplier: w ≈ fp8 * scale_inv), the modules_to_not_convert
left as they were. Written block by block with transformers' formula, independently of nanograph's quantizer.
make_per_tensor_fp8_checkpoint: vLLM's per-tensor FP8 format (AutoFP8's), one float32 `weight_scale` per linear."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK = 128
FP8_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [n, k], weight_scale_inv [ceil(n / 128), ceil(k / 128)]), one block at a time."""
    n, k = weight.shape
    fp8 = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(-(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32)
    for r in range(scale_inv.shape[0]):
        for c in range(scale_inv.shape[1]):
            block = weight[r * BLOCK:(r + 1) * BLOCK, c * BLOCK:(c + 1) * BLOCK].float()
            amax = block.abs().max().item()
            scale = FP8_MAX / amax if amax > 0 else 1.0
            fp8[r * BLOCK:(r + 1) * BLOCK, c * BLOCK:(c + 1) * BLOCK] = (block * scale).clamp(
                -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scale_inv[r, c] = 1.0 / scale
    return fp8, scale_inv


def make_fp8_checkpoint(src_folder, dst_folder, modules_to_not_convert=("lm_head",)) -> Path:
    """Copies src_folder's files to dst_folder with its linears (model.layers.*.{q,k,v,o,gate,up,down}_proj and an
    untied lm_head) in FP8, except the modules named in modules_to_not_convert (e.g.
    "model.layers.0.self_attn.k_proj")."""
    def quantize(module: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if module in modules_to_not_convert:
            return None
        fp8, scale_inv = quantize_blocks(tensor)
        return {module + ".weight": fp8, module + ".weight_scale_inv": scale_inv}

    return _converted(src_folder, dst_folder, quantize, {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": list(modules_to_not_convert)})


def make_per_tensor_fp8_checkpoint(src_folder, dst_folder, activation_scheme: str = "static") -> Path:
    """Copies src_folder's files to dst_folder in vLLM's per-tensor FP8 format: quantization_config without
    weight_block_size (lm_head in ignored_layers), each layer's linear in float8_e4m3fn with a scalar float32
    `weight_scale` (w ≈ fp8 * weight_scale) and, for activation_scheme "static", a scalar `input_scale`."""
    def quantize(module: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not module.startswith("model.layers."):
            return None
        scale = tensor.float().abs().max() / FP8_MAX
        out = {module + ".weight": (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),
               module + ".weight_scale": scale.reshape(())}
        if activation_scheme == "static":
            out[module + ".input_scale"] = torch.tensor(0.05)
        return out

    return _converted(src_folder, dst_folder, quantize, {
        "quant_method": "fp8", "activation_scheme": activation_scheme, "ignored_layers": ["lm_head"]})


def _converted(src_folder, dst_folder, quantize, quantization_config: dict) -> Path:
    """src_folder's files in dst_folder, config.json with quantization_config, each linear's weight replaced by what
    quantize(module, weight) gives (None: kept as it is)."""
    src, dst = Path(src_folder), Path(dst_folder)
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                module = name.removesuffix(".weight")
                converted = quantize(module, tensor) if name.endswith(".weight") and \
                    module.rsplit(".", 1)[-1] in LINEARS else None
                tensors.update(converted or {name: tensor})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
