"""FP8 weights (CPU): the block quantizer and its reference dequantizer, load_weights' packed FP8 linears from Hugging
Face's fine-grained FP8 checkpoints (and from quantization="fp8"), transformers reading the same checkpoints, the real
SmolLM2 in FP8 answering "Paris", and the errors for what nanograph does not run."""
import json
import math
import types

import numpy as np
import pytest
import torch
from safetensors import safe_open

from nanograph import LLM, SamplingParams
from nanograph.backends.torch_backend import TorchRunner
from nanograph.config import Config
from nanograph.default_model import default_model_path
from nanograph.model_config import ModelConfig
from nanograph.models import load_weights
from nanograph.models.fp8 import (BLOCK_SIZE, FP8_DTYPE, PACKED_SCALE_ROWS, dequantize_fp8, expand_block_scales,
                                  quantize_fp8)

from ..fp8_checkpoint import make_fp8_checkpoint, make_per_tensor_fp8_checkpoint
from .test_torch_backend import forward_batch, hf_logits
from .tiny_models import _save_random_model

# hidden 200 and intermediate 296: multiples of 8, not of 128; q 200 rows, k and v 40 each (head_dim 40, 1 KV head).
ODD = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=200, num_hidden_layers=2,
           num_attention_heads=5, num_key_value_heads=1, intermediate_size=296, vocab_size=256,
           max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e4)
# Every linear a whole number of 128 x 128 blocks: transformers' own dequantizer takes only those.
WHOLE_BLOCKS = {**ODD, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "intermediate_size": 384}
E4M3_RELATIVE = 2 ** -4  # half the spacing of 3 mantissa bits
LINEAR_PIECES = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "down_proj": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def odd_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("odd")
    _save_random_model(folder, ODD, seed=0)
    return folder


@pytest.fixture(scope="module")
def odd_fp8_folder(odd_folder, tmp_path_factory):
    return make_fp8_checkpoint(odd_folder, tmp_path_factory.mktemp("odd-fp8"))


def checkpoint_tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def hand_expanded(block_scales: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.stack([block_scales[r * PACKED_SCALE_ROWS // BLOCK_SIZE] for r in range(-(-rows // 8))])


def block_amax(weight: torch.Tensor) -> torch.Tensor:
    """Each element's 128 x 128 block's largest magnitude, [n, k]."""
    n, k = weight.shape
    out = torch.empty(n, k)
    for r in range(0, n, BLOCK_SIZE):
        for c in range(0, k, BLOCK_SIZE):
            out[r:r + BLOCK_SIZE, c:c + BLOCK_SIZE] = weight[r:r + BLOCK_SIZE, c:c + BLOCK_SIZE].abs().max()
    return out


def test_expanded_scales_repeat_each_block_scale_over_its_8_row_groups():
    block_scales = torch.rand(2, 3) + 0.1  # a weight [200, 300]
    packed = expand_block_scales(block_scales, (200, 300))
    assert packed.dtype == torch.float32 and packed.shape == (25, 3) and packed.is_contiguous()
    assert torch.equal(packed, hand_expanded(block_scales, 200))
    with pytest.raises(ValueError, match=r"block scales of shape \[3, 3\] do not fit a weight \[200, 300\] in 128 x "
                                         r"128 blocks, which needs \[2, 3\]"):
        expand_block_scales(torch.ones(3, 3), (200, 300))


@pytest.mark.parametrize("rows_per_scale", [PACKED_SCALE_ROWS, BLOCK_SIZE])
def test_dequantize_multiplies_each_element_by_its_blocks_scale(rows_per_scale):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(200, 300, generator=gen) * 100).to(FP8_DTYPE)
    scale = torch.rand(-(-200 // rows_per_scale), 3, generator=gen)
    rows, cols = torch.meshgrid(torch.arange(200), torch.arange(300), indexing="ij")
    expected = weight.float() * scale[rows // rows_per_scale, cols // 128]
    assert torch.equal(dequantize_fp8(weight, scale, rows_per_scale), expected)


@pytest.mark.parametrize("shape", [(200, 300), (128, 128), (1, 5), (257, 129), (576, 1536)])
def test_quantize_then_dequantize_is_within_e4m3_precision(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    # Blocks of very different magnitudes: each must get its own scale.
    weight = torch.randn(shape, generator=gen) * torch.logspace(-4, 2, shape[0])[:, None]
    fp8, scales = quantize_fp8(weight.to(torch.bfloat16))
    weight = weight.to(torch.bfloat16).float()
    assert fp8.dtype == FP8_DTYPE and fp8.shape == shape and fp8.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    amax = block_amax(weight)
    restored = dequantize_fp8(fp8, scales, rows_per_scale=BLOCK_SIZE)
    assert ((restored - weight).abs() <= E4M3_RELATIVE * amax).all()
    # Each block's largest magnitude maps to e4m3's largest value, 448.
    assert torch.equal(block_amax(fp8.float()), torch.full(shape, 448.0))
    torch.testing.assert_close(scales, amax[::128, ::128] / 448, rtol=0, atol=0)


def test_an_all_zero_block_quantizes_to_zeros_with_scale_one():
    weight = torch.randn(256, 200)
    weight[128:, :128] = 0
    fp8, scales = quantize_fp8(weight)
    assert scales[1, 0] == 1.0 and (fp8[128:, :128].float() == 0).all()
    restored = dequantize_fp8(fp8, scales, rows_per_scale=BLOCK_SIZE)
    assert torch.isfinite(restored).all() and (restored[128:, :128] == 0).all()


def test_our_quantizer_agrees_with_transformers():
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(3)) * torch.rand(256, 1) * 4
    op = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config()))
    theirs = op.convert({"w.weight": weight})
    fp8, scales = quantize_fp8(weight)
    torch.testing.assert_close(scales, theirs["w.weight_scale_inv"], rtol=1e-6, atol=0)
    # Both round to nearest; w / s and w * (1 / s) may differ in the last float bit, so at most one e4m3 step apart.
    ours_values, their_values = fp8.float(), theirs["w.weight"].float()
    assert ((ours_values - their_values).abs() <= ours_values.abs() * 2 * E4M3_RELATIVE + 2 ** -9).all()
    assert (ours_values == their_values).float().mean() > 0.99


def test_an_fp8_checkpoint_loads_as_packed_fp8_linears(odd_folder, odd_fp8_folder):
    mc = ModelConfig.from_pretrained(odd_fp8_folder)
    assert mc.quantization == "fp8"
    weights = load_weights(odd_fp8_folder, mc, torch.float32, "cpu")
    dequantized = load_weights(odd_fp8_folder, mc, torch.bfloat16, "cpu", dequantize=True)
    stored, original = checkpoint_tensors(odd_fp8_folder), checkpoint_tensors(odd_folder)
    for i in range(mc.num_layers):
        for name, pieces in LINEAR_PIECES.items():
            hf = [f"model.layers.{i}.{piece}.weight" for piece in pieces]
            packed, scales = weights[f"layers.{i}.{name}"], weights[f"layers.{i}.{name}_scale"]
            assert packed.dtype == FP8_DTYPE and packed.is_contiguous()
            assert torch.equal(packed.view(torch.uint8), torch.cat([stored[p] for p in hf]).view(torch.uint8))
            assert scales.dtype == torch.float32 and scales.is_contiguous()
            assert scales.shape == (math.ceil(packed.shape[0] / 8), math.ceil(packed.shape[1] / 128))
            assert torch.equal(scales, torch.cat([hand_expanded(stored[p + "_scale_inv"], stored[p].shape[0])
                                                  for p in hf]))
            each = torch.cat([dequantize_fp8(stored[p], stored[p + "_scale_inv"], BLOCK_SIZE) for p in hf])
            assert torch.equal(dequantized[f"layers.{i}.{name}"], each.to(torch.bfloat16))
            assert f"layers.{i}.{name}_scale" not in dequantized
        assert torch.equal(weights[f"layers.{i}.input_layernorm"], original[f"model.layers.{i}.input_layernorm.weight"])
    assert torch.equal(weights["lm_head"], original["lm_head.weight"])  # in modules_to_not_convert
    assert torch.equal(weights["embed_tokens"], original["model.embed_tokens.weight"])


def test_pieces_left_unquantized_are_quantized_at_load(odd_folder, tmp_path):
    """A fused group with an unquantized piece (k_proj) and an unquantized linear (down_proj) of an FP8 checkpoint:
    quantized at load, so that each packed linear is FP8; an FP8 lm_head is dequantized."""
    kept = ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj")
    folder = make_fp8_checkpoint(odd_folder, tmp_path / "mixed", modules_to_not_convert=kept)
    stored, original = checkpoint_tensors(folder), checkpoint_tensors(odd_folder)
    assert stored["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float32
    assert stored["lm_head.weight"].dtype == FP8_DTYPE
    mc = ModelConfig.from_pretrained(folder)
    weights = load_weights(folder, mc, torch.float32, "cpu")
    k_fp8, k_scales = quantize_fp8(original["model.layers.0.self_attn.k_proj.weight"])
    q_rows = mc.num_heads * mc.head_dim
    packed = weights["layers.0.qkv_proj"]
    assert packed.dtype == FP8_DTYPE
    assert torch.equal(packed[q_rows:q_rows + 40].view(torch.uint8), k_fp8.view(torch.uint8))
    assert torch.equal(weights["layers.0.qkv_proj_scale"][q_rows // 8:(q_rows + 40) // 8],
                       expand_block_scales(k_scales, k_fp8.shape))
    down_fp8, down_scales = quantize_fp8(original["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(weights["layers.1.down_proj"].view(torch.uint8), down_fp8.view(torch.uint8))
    assert torch.equal(weights["layers.1.down_proj_scale"], expand_block_scales(down_scales, down_fp8.shape))
    assert torch.equal(weights["lm_head"], dequantize_fp8(stored["lm_head.weight"], stored["lm_head.weight_scale_inv"],
                                                          BLOCK_SIZE))


@pytest.mark.parametrize("activation_scheme", ["static", "dynamic"])
def test_a_per_tensor_fp8_checkpoint_runs_as_its_dequantized_weights(odd_folder, tmp_path, activation_scheme):
    """vLLM's per-tensor FP8 format (no weight_block_size; a weight_scale per linear; a static checkpoint's input
    scales unread): each piece's scale in every block of its rows, and the torch backend's logits those of the
    float model that holds the dequantized weights."""
    from transformers import AutoModelForCausalLM

    folder = make_per_tensor_fp8_checkpoint(odd_folder, tmp_path / "fp8", activation_scheme)
    stored = checkpoint_tensors(folder)
    mc = ModelConfig.from_pretrained(folder)
    assert mc.quantization == "fp8"
    weights = load_weights(folder, mc, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(odd_folder, dtype=torch.float32).eval()
    for i in range(mc.num_layers):
        for name, pieces in LINEAR_PIECES.items():
            modules = [f"model.layers.{i}.{piece}" for piece in pieces]
            packed, scales = weights[f"layers.{i}.{name}"], weights[f"layers.{i}.{name}_scale"]
            assert torch.equal(packed.view(torch.uint8),
                               torch.cat([stored[m + ".weight"] for m in modules]).view(torch.uint8))
            assert torch.equal(scales, torch.cat([stored[m + ".weight_scale"].expand(
                -(-stored[m + ".weight"].shape[0] // 8), -(-packed.shape[1] // 128)) for m in modules]))
            for m in modules:
                with torch.no_grad():
                    hf.get_submodule(m).weight.copy_(stored[m + ".weight"].float() * stored[m + ".weight_scale"])
    assert torch.equal(weights["lm_head"], stored["lm_head.weight"])  # in ignored_layers
    runner = TorchRunner(mc, block_size=4, num_kv_blocks=64, max_model_len=128)
    prompt = np.random.default_rng(1).integers(0, 256, 19).tolist()
    logits = runner.run(forward_batch([(list(range(5)), 0, prompt)]))
    torch.testing.assert_close(logits[0], hf_logits(hf, prompt)[-1], rtol=1e-4, atol=1e-4)


def test_a_per_channel_fp8_scale_is_a_value_error(odd_folder, tmp_path):
    folder = make_per_tensor_fp8_checkpoint(odd_folder, tmp_path / "fp8", "dynamic")
    from safetensors.torch import save_file
    tensors = checkpoint_tensors(folder)
    name = "model.layers.0.mlp.down_proj"
    tensors[name + ".weight_scale"] = tensors[name + ".weight_scale"].expand(200).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name}.weight_scale in .* holds 200 scales; nanograph reads FP8 weights "
                                         "with one scale per tensor"):
        load_weights(folder, ModelConfig.from_pretrained(folder), torch.float32, "cpu")


def test_quantization_fp8_quantizes_a_float_checkpoint_at_load(odd_folder):
    mc = ModelConfig.from_pretrained(odd_folder)
    assert mc.quantization is None
    assert load_weights(odd_folder, mc, torch.float32, "cpu")["layers.0.o_proj"].dtype == torch.float32
    weights = load_weights(odd_folder, mc, torch.float32, "cpu", quantization="fp8")
    dequantized = load_weights(odd_folder, mc, torch.float32, "cpu", quantization="fp8", dequantize=True)
    original = checkpoint_tensors(odd_folder)
    for name, pieces in LINEAR_PIECES.items():
        hf = [original[f"model.layers.1.{piece}.weight"] for piece in pieces]
        quantized = [quantize_fp8(w) for w in hf]
        assert torch.equal(weights[f"layers.1.{name}"].view(torch.uint8),
                           torch.cat([q for q, _ in quantized]).view(torch.uint8))
        assert torch.equal(weights[f"layers.1.{name}_scale"],
                           torch.cat([expand_block_scales(s, q.shape) for q, s in quantized]))
        error = (dequantized[f"layers.1.{name}"] - torch.cat(hf)).abs()
        assert (error <= E4M3_RELATIVE * torch.cat([block_amax(w) for w in hf])).all()
    assert torch.equal(weights["lm_head"], original["lm_head.weight"])
    with pytest.raises(ValueError, match=r"quantization='int8' is not supported; use None \(the checkpoint's format\) "
                                         r"or one of \['fp8'\]"):
        load_weights(odd_folder, mc, torch.float32, "cpu", quantization="int8")


def test_fused_pieces_must_meet_at_a_multiple_of_8_rows(tmp_path):
    _save_random_model(tmp_path, {**ODD, "intermediate_size": 300}, seed=0)
    mc = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="layers.0.gate_up_proj: a fused piece of 300 rows would split a group of 8 "
                                         "rows that share one FP8 scale"):
        load_weights(tmp_path, mc, torch.float32, "cpu", quantization="fp8")


def test_the_torch_backend_runs_an_fp8_checkpoint_as_transformers_does(tmp_path):
    """transformers, dequantizing, reads the checkpoint as nanograph does: the same dequantized weights and the same
    logits. (It dequantizes by itself where no GPU is visible, and keeps e4m3 weights where one is: dequantize=True
    asks for the former everywhere; test_fp8_gpu.py compares with its FP8 forward.)"""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints with accelerate")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    _save_random_model(tmp_path / "float", WHOLE_BLOCKS, seed=1)
    folder = make_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    stored = checkpoint_tensors(folder)
    name = "model.layers.1.mlp.gate_proj"
    assert torch.equal(hf.get_submodule(name).weight.float(),
                       dequantize_fp8(stored[name + ".weight"], stored[name + ".weight_scale_inv"], BLOCK_SIZE))
    runner = TorchRunner(ModelConfig.from_pretrained(folder), block_size=4, num_kv_blocks=64, max_model_len=128)
    prompt = np.random.default_rng(0).integers(0, 256, 21).tolist()
    logits = runner.run(forward_batch([(list(range(6)), 0, prompt)]))
    torch.testing.assert_close(logits[0], hf_logits(hf, prompt)[-1], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def smollm2_fp8(tmp_path_factory):
    return make_fp8_checkpoint(default_model_path(), tmp_path_factory.mktemp("smollm2-fp8"))


@pytest.mark.parametrize("source", ["fp8 checkpoint", "quantization='fp8'"])
def test_smollm2_in_fp8_knows_the_capital_of_france(smollm2_fp8, source):
    llm = LLM(str(smollm2_fp8), device="cpu") if source == "fp8 checkpoint" else \
        LLM(default_model_path(), quantization="fp8", device="cpu")
    assert llm.engine.runner.model_config.quantization == ("fp8" if source == "fp8 checkpoint" else None)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "gptq"}, "quantization_config has quant_method 'gptq', which nanograph does not run; it loads "
                               "['fp8'] checkpoints"),
    ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors', which nanograph does not run"),
    ({"activation_scheme": "tensorwise"}, "quantization_config has activation_scheme 'tensorwise'; nanograph runs "
                                          "FP8 checkpoints of activation_scheme 'dynamic' or 'static'"),
    ({"weight_block_size": [64, 64]}, "quantization_config has weight_block_size [64, 64]; nanograph's FP8 weights "
                                      "have one scale per [128, 128] block"),
    ({"weight_block_size": None}, "weight_block_size None"),
    ({"fmt": "e5m2"}, "quantization_config has fmt 'e5m2'; nanograph's FP8 weights are e4m3"),
])
def test_a_quantization_config_nanograph_does_not_run_is_a_value_error(odd_folder, tmp_path, change, message):
    config = json.loads((odd_folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        ModelConfig.from_pretrained(tmp_path)
    assert message in str(info.value)
    assert "quantization='fp8'" in str(info.value) or "use an e4m3 checkpoint" in str(info.value)


@pytest.mark.parametrize("field, value, message", [
    ("quantization", "awq", "quantization='awq' is not supported yet: nanograph runs FP8 weights (an FP8 checkpoint's, "
                            "or quantized at load); use quantization='fp8', or None for the checkpoint's format"),
])
def test_config_rejects_what_it_does_not_run(field, value, message):
    with pytest.raises(ValueError) as info:
        Config(**{field: value})
    assert message in str(info.value)


def test_an_fp8_tensor_without_its_block_scales_is_a_value_error_naming_them(odd_fp8_folder, tmp_path):
    """Read without its scales, an e4m3 tensor would run as if every scale were 1."""
    from safetensors.torch import save_file

    folder = tmp_path / "unscaled"
    folder.mkdir()
    (folder / "config.json").write_text((odd_fp8_folder / "config.json").read_text())
    missing = "model.layers.1.mlp.down_proj.weight_scale_inv"
    save_file({name: t for name, t in checkpoint_tensors(odd_fp8_folder).items() if name != missing},
              str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"model.layers.1.mlp.down_proj.weight in FP8 without its block scales "
                                         f"{missing} \\(or a per-tensor model.layers.1.mlp.down_proj.weight_scale\\)"):
        load_weights(folder, ModelConfig.from_pretrained(folder), torch.float32, "cpu")


@pytest.mark.parametrize("field, change", [("hidden_size", dict(hidden_size=200)),
                                           ("intermediate_size", dict(intermediate_size=296)),
                                           ("num_attention_heads x head_dim", dict(num_heads=3, head_dim=12))])
def test_the_cuda_core_names_a_width_its_fp8_gemv_cannot_read(field, change):
    from nanograph.models.fp8 import check_core_shapes

    widths = dict(hidden_size=256, intermediate_size=512, num_heads=4, head_dim=64)
    check_core_shapes(types.SimpleNamespace(**widths))  # multiples of 16: no error
    with pytest.raises(ValueError, match=f"need {field} to be a multiple of 16.*without quantization"):
        check_core_shapes(types.SimpleNamespace(**{**widths, **change}))
