"""FP8 weights: Hugging Face's fine-grained format (e4m3 values, one float32 scale per 128x128 block) and the packed
form the engine consumes, whose scales cover 8 rows each so that fused q|k|v and gate|up pieces stay exact.

A weight w [n, k] is w ≈ float(fp8) * scale, the scale of the block holding each element. HF calls its block scales
`weight_scale_inv` (they are multipliers all the same); `expand_block_scales` turns them into packed scales, and
`gemm_block_scales` back into one scale per 128 x 128 block for the CUDA core's block-scaled FP8 GEMM, whose
activations `quantize_activations` quantizes as that GEMM's kernel does (the torch reference)."""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
BLOCK_SIZE = 128  # rows and columns of a checkpoint's scale block: weight_block_size [128, 128]
PACKED_SCALE_ROWS = 8  # rows of a packed scale: the granularity at which fused pieces meet
PACKED_SCALE_COLS = BLOCK_SIZE  # columns of a packed scale, as in the checkpoint


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] -> (fp8 [n, k], block scales float32 [ceil(n / 128), ceil(k / 128)]): each block's scale is its
    largest magnitude / 448 (1 for an all-zero block), computed in float32 on weight's device."""
    n, k = weight.shape
    blocks_n, blocks_k = -(-n // BLOCK_SIZE), -(-k // BLOCK_SIZE)
    padded = torch.zeros(blocks_n * BLOCK_SIZE, blocks_k * BLOCK_SIZE, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight
    blocks = padded.view(blocks_n, BLOCK_SIZE, blocks_k, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    fp8 = blocks.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return fp8.view(blocks_n * BLOCK_SIZE, blocks_k * BLOCK_SIZE)[:n, :k].contiguous(), scale


def expand_block_scales(block_scales: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A checkpoint's block scales [ceil(n / 128), ceil(k / 128)] of a weight of shape [n, k], as packed scales
    [ceil(n / 8), ceil(k / 128)] float32: each repeated 128 / 8 times, trimmed to the weight's rows."""
    n, k = shape
    expected = (-(-n // BLOCK_SIZE), -(-k // BLOCK_SIZE))
    if tuple(block_scales.shape) != expected:
        raise ValueError(f"block scales of shape {list(block_scales.shape)} do not fit a weight {list(shape)} in "
                         f"{BLOCK_SIZE} x {BLOCK_SIZE} blocks, which needs {list(expected)}")
    repeated = block_scales.float().repeat_interleave(BLOCK_SIZE // PACKED_SCALE_ROWS, dim=0)
    return repeated[:-(-n // PACKED_SCALE_ROWS)].contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (fp8 [m, k], scales float32 [ceil(k / 128), m]): one scale per row per 128 columns, the group's
    largest magnitude / 448 (1 for an all-zero group), and x / scale rounded to e4m3 (nearest even, saturating at 448),
    in float32 on x's device. Hugging Face's FineGrainedFP8 layers (activation_scheme "dynamic") and vLLM quantize a
    token's activations so for their FP8 GEMM; the CUDA core's quantize_fp8_activations writes the same bits, its
    scales laid out [group, row] as its FP8 GEMM reads them. Divisions are by tensors: a division by a Python number
    may be computed as a multiplication by its reciprocal, which can differ in the last bit."""
    m, k = x.shape
    groups = -(-k // PACKED_SCALE_COLS)
    padded = torch.zeros(m, groups * PACKED_SCALE_COLS, dtype=torch.float32, device=x.device)
    padded[:, :k] = x
    blocks = padded.view(m, groups, PACKED_SCALE_COLS)
    amax = blocks.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    fp8 = (blocks / scale[:, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, -1)[:, :k].contiguous()
    return fp8, scale.t().contiguous()


def dequantize_activations(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [m, k] = float(fp8) * the scale of each element's row and 128-column group (quantize_activations)."""
    k = fp8.shape[1]
    return fp8.float() * scale.t().repeat_interleave(PACKED_SCALE_COLS, dim=1)[:, :k]


def gemm_block_scales(scale: torch.Tensor) -> torch.Tensor | None:
    """Packed scales [ceil(n / 8), ceil(k / 128)] as one scale per 128 x 128 block, in the layout of the CUDA core's
    block-scaled FP8 GEMM (cuBLASLt's BLK128x128 scales, csrc/fp8.h): float32 [ceil(n / 128), ceil(k / 128) rounded up
    to 4], the extra columns zero. None where some 128-row block's 8-row scales differ (a fused piece whose rows are
    not a multiple of 128 shares a block with the next): such a weight is multiplied dequantized on the GPU."""
    groups_per_block = BLOCK_SIZE // PACKED_SCALE_ROWS
    per_block = scale[::groups_per_block]
    if not torch.equal(per_block.repeat_interleave(groups_per_block, dim=0)[:scale.shape[0]], scale):
        return None
    cols = scale.shape[1]
    out = torch.zeros(per_block.shape[0], -(-cols // 4) * 4, dtype=torch.float32, device=scale.device)
    out[:, :cols] = per_block
    return out


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, rows_per_scale: int = PACKED_SCALE_ROWS) -> torch.Tensor:
    """float32 [n, k] = float(weight) * the scale of each element's block: rows_per_scale rows (8: packed scales, 128:
    a checkpoint's) by 128 columns. The reference every FP8 path is checked against."""
    n, k = weight.shape
    if scale.shape != (-(-n // rows_per_scale), -(-k // PACKED_SCALE_COLS)):
        raise ValueError(f"scale of shape {list(scale.shape)} does not fit a weight [{n}, {k}] in blocks of "
                         f"{rows_per_scale} x {PACKED_SCALE_COLS}")
    row_scales = scale.float().repeat_interleave(rows_per_scale, dim=0)[:n]  # [n, ceil(k / 128)]
    out = weight.float()
    full_blocks = k // PACKED_SCALE_COLS
    out[:, :full_blocks * PACKED_SCALE_COLS].unflatten(1, (full_blocks, PACKED_SCALE_COLS)).mul_(
        row_scales[:, :full_blocks, None])
    out[:, full_blocks * PACKED_SCALE_COLS:].mul_(row_scales[:, full_blocks:])
    return out


def check_core_shapes(mc) -> None:
    """The CUDA core reads an FP8 weight 16 columns at a time: every linear's input width (hidden_size,
    num_attention_heads x head_dim, intermediate_size) must be a multiple of 16. A ValueError naming the first that
    is not, and the fix."""
    widths = {"hidden_size": mc.hidden_size, "num_attention_heads x head_dim": mc.num_heads * mc.head_dim,
              "intermediate_size": mc.intermediate_size}
    for field, width in widths.items():
        if width % 16:
            raise ValueError(f"FP8 weights on the CUDA core need {field} to be a multiple of 16, got {width}; run "
                             f"this model without quantization, or on the torch backend (device='cpu' or "
                             f"'torch:cuda')")
