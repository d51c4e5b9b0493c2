"""Benchmark cases for FP8-weight linears at prefill size (M = 8,192 tokens) on the Qwen3-8B projections, four ways on
the same shape, so that the FP8 / bf16 ratio reads off one run: the block-scaled FP8 GEMM alone (activations quantized
beforehand; the quantization is also timed alone, once per K), the same with the activation quantization (what
Gemm.linear_fp8 runs with block scales), the dequantising path (the weight dequantised to bf16, then the bf16 GEMM: FP8
weights without block scales), and the bf16 cuBLASLt GEMM of a bf16 weight. TFLOP/s count 2 M N K for each."""
import torch

from nanograph import ops
from nanograph.models.fp8 import expand_block_scales, gemm_block_scales

from .gemv import SHAPES

M = 8192
PROJECTIONS = [(name, N, K) for name, N, K in SHAPES if name.startswith("8B") and "lm_head" not in name]


def fp8_weight(N, K):
    q = (torch.randn(N, K, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    hf = torch.rand(-(-N // 128), -(-K // 128), device="cuda") * K**-0.5 / 64
    packed = expand_block_scales(hf, (N, K))
    return q, packed, gemm_block_scales(packed)


def cases():
    gemm = ops.Gemm()
    quantized_k = set()
    for name, N, K in PROJECTIONS:
        q, packed, blocks = fp8_weight(N, K)
        bf16 = (torch.randn(N, K, device="cuda") * K**-0.5).to(torch.bfloat16)
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        x_q = torch.empty(M, K, device="cuda", dtype=torch.float8_e4m3fn)
        x_scale = torch.empty(-(-K // 128), M, device="cuda")
        ops.quantize_fp8_activations(x, x_q, x_scale)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        shape, flops = f"M={M} N={N} K={K}", 2 * M * N * K
        if K not in quantized_k:  # the activation quantization alone: 2 bytes read, 1 written, per element
            quantized_k.add(K)
            yield (f"quantize_fp8_activations M={M} K={K}", lambda: ops.quantize_fp8_activations(x, x_q, x_scale),
                   3 * M * K + 4 * x_scale.numel(), 0)
        if not gemm.fp8_gemm_supported(M, N, K, False):
            print(f"gemm_fp8 {name} {shape}: cuBLASLt has no block-scaled FP8 GEMM on this device; skipped")
        else:
            yield (f"gemm_fp8 blocks {name} {shape}",
                   lambda: gemm.linear_fp8_quantized(x_q, x_scale, q, blocks, None, out), 0, flops)
            yield (f"gemm_fp8 +quant {name} {shape}",
                   lambda: gemm.linear_fp8(x, q, packed, None, out, block_scale=blocks), 0, flops)
        yield (f"gemm_fp8 dequant {name} {shape}", lambda: gemm.linear_fp8(x, q, packed, None, out), 0, flops)
        yield f"gemm bf16 {name} {shape}", lambda: gemm.linear(x, bf16, None, out), 0, flops
