"""The operands of the CUDA core's block-scaled FP8 GEMM, built on the CPU: the weights' scales once per 128 x 128
block (gemm_block_scales, block_scales of load_weights' result; None where fused pieces share a block), and the
activations quantized per row and 128 columns (quantize_activations), against hand-computed values."""
import math

import pytest
import torch

from nanograph.model_config import ModelConfig
from nanograph.models import load_weights
from nanograph.models.fp8 import (FP8_DTYPE, FP8_MAX, dequantize_activations, expand_block_scales,
                                  gemm_block_scales, quantize_activations)
from nanograph.models.weights import BLOCK_SCALE_SUFFIX, block_scales

from ..fp8_checkpoint import make_fp8_checkpoint
from .test_fp8_weights import ODD, WHOLE_BLOCKS, checkpoint_tensors
from .tiny_models import _save_random_model

E4M3_RELATIVE = 2 ** -4


@pytest.mark.parametrize("shape", [(300, 600), (128, 128), (8, 16), (1000, 1040)])
def test_block_scales_are_the_checkpoints_padded_to_4_columns(shape):
    n, k = shape
    hf = torch.rand(math.ceil(n / 128), math.ceil(k / 128), generator=torch.Generator().manual_seed(n)) + 0.1
    blocks = gemm_block_scales(expand_block_scales(hf, shape))
    cols = math.ceil(math.ceil(k / 128) / 4) * 4
    assert blocks.dtype == torch.float32 and blocks.shape == (hf.shape[0], cols) and blocks.is_contiguous()
    assert torch.equal(blocks[:, :hf.shape[1]], hf)
    assert (blocks[:, hf.shape[1]:] == 0).all()


def test_a_128_row_block_whose_8_row_scales_differ_has_no_block_scale():
    packed = expand_block_scales(torch.rand(3, 2) + 0.1, (300, 256))
    packed[17, 1] *= 2  # rows 136..143: inside the second 128-row block
    assert gemm_block_scales(packed) is None
    packed = expand_block_scales(torch.rand(3, 2) + 0.1, (300, 256))
    packed[-1, 0] *= 2  # the last, partial block's last 8 rows
    assert gemm_block_scales(packed) is None


def test_loaded_fp8_linears_get_block_scales_where_their_pieces_fill_whole_blocks(tmp_path):
    """WHOLE_BLOCKS: every piece a multiple of 128 rows, so each linear's block scales are its checkpoint's. ODD: q, k
    and v (200, 40, 40 rows) and gate and up (296 each) share blocks, o_proj and down_proj are one piece each."""
    whole = tmp_path / "whole"
    _save_random_model(whole, WHOLE_BLOCKS, seed=1)
    fp8_folder = make_fp8_checkpoint(whole, tmp_path / "whole-fp8")
    weights = load_weights(fp8_folder, ModelConfig.from_pretrained(fp8_folder), torch.float32, "cpu")
    stored = checkpoint_tensors(fp8_folder)
    extra = block_scales(weights)
    pieces = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
              "down_proj": ("mlp.down_proj",)}
    assert set(extra) == {f"layers.{i}.{name}{BLOCK_SCALE_SUFFIX}" for i in range(2) for name in pieces}
    for i in range(2):
        for name, parts in pieces.items():
            hf = torch.cat([stored[f"model.layers.{i}.{p}.weight_scale_inv"] for p in parts])
            got = extra[f"layers.{i}.{name}{BLOCK_SCALE_SUFFIX}"]
            assert torch.equal(got[:, :hf.shape[1]], hf) and (got[:, hf.shape[1]:] == 0).all()

    odd = tmp_path / "odd"
    _save_random_model(odd, ODD, seed=0)
    odd_weights = load_weights(odd, ModelConfig.from_pretrained(odd), torch.float32, "cpu", quantization="fp8")
    assert set(block_scales(odd_weights)) == {f"layers.{i}.{name}{BLOCK_SCALE_SUFFIX}" for i in range(2)
                                              for name in ("o_proj", "down_proj")}
    assert block_scales(load_weights(odd, ModelConfig.from_pretrained(odd), torch.float32, "cpu")) == {}


def test_activations_take_one_scale_per_row_and_128_columns():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 300, generator=gen) * torch.logspace(-3, 3, 5)[:, None]).to(torch.bfloat16)
    x[2, 128:256] = 0
    x[3, 7] = 1e4  # an outlier: its group's scale is set by it
    fp8, scale = quantize_activations(x)
    assert fp8.dtype == FP8_DTYPE and fp8.shape == (5, 300) and scale.shape == (3, 5) and scale.is_contiguous()
    xf = x.float()
    for m in range(5):
        for g in range(3):
            group = xf[m, 128 * g:128 * (g + 1)]
            amax = group.abs().max()
            expected_scale = amax / torch.tensor(FP8_MAX) if amax > 0 else torch.tensor(1.0)
            assert scale[g, m] == expected_scale, (m, g)
            expected = (group / expected_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            assert torch.equal(fp8[m, 128 * g:128 * (g + 1)].view(torch.uint8), expected.view(torch.uint8)), (m, g)
    assert scale[1, 2] == 1.0 and (fp8[2, 128:256].float() == 0).all()
    assert fp8[3, 7].float() == FP8_MAX
    restored = dequantize_activations(fp8, scale)
    group_amax = torch.stack([xf[:, 128 * g:128 * (g + 1)].abs().amax(1) for g in range(3)], 1)
    assert ((restored - xf).abs() <= E4M3_RELATIVE * group_amax.repeat_interleave(128, 1)[:, :300]).all()
