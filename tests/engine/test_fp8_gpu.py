"""FP8 weights on the CUDA core (GPU): a checkpoint that transformers quantized (FineGrainedFP8Config, saved with
save_pretrained) and a float32 one quantized at load run as the float32 torch backend runs their FP8 values, and
transformers reads the checkpoint as nanograph does.

transformers' own FP8 matmul needs a kernel from the Hub (unreachable here), so its side of the comparison is its
bfloat16 forward of the dequantized checkpoint (FineGrainedFP8Config(dequantize=True)). The core's error against
the float32 reference is held to that of a bfloat16 torch forward of the same FP8 values plus that of quantizing the
projections' activations: decode steps (up to 16 tokens) read bf16 activations in the FP8 GEMV, while the prefill
step's projections, whose scales come in whole 128 x 128 blocks here, quantize their activations to e4m3 per token
and 128 columns for the block-scaled FP8 GEMM (as transformers' FP8 layers and vLLM do). The second yardstick is the
float32 torch forward with those activations quantized the same way at the same steps."""
import gc
import types

import pytest
import torch

from nanograph.config import Config
from nanograph.model_config import ModelConfig
from nanograph import ops
from nanograph.backends import torch_backend
from nanograph.models.fp8 import FP8_DTYPE, dequantize_activations, quantize_activations

from .test_cuda_backend import BLOCK, Tables

pytestmark = pytest.mark.gpu

# Every linear a whole number of 128 x 128 blocks (transformers quantizes only those); GQA 4, an untied lm_head.
SPEC = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=512, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1024, vocab_size=1024,
            max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e4)
PROMPT_LENS = [37, 100, 5]
DECODE_STEPS = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the float32 folder, with transformers' initialization: near-flat logits; its FP8 folder that transformers
    quantized and saved; that checkpoint dequantized by transformers, in bfloat16 on the GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config

    source = tmp_path_factory.mktemp("float32")
    spec = dict(SPEC)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec),
                                     dtype=torch.float32).save_pretrained(source)
    quantized = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16, device_map="cuda",
                                                     quantization_config=FineGrainedFP8Config())
    fp8 = tmp_path_factory.mktemp("fp8")
    quantized.save_pretrained(fp8)
    del quantized
    hf = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.bfloat16, device_map="cuda",
                                              quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    yield source, fp8, hf
    del hf
    gc.collect()
    torch.cuda.empty_cache()


def teacher_forced_logprobs(runner, seqs) -> list[torch.Tensor]:
    """Each sequence's logprobs [DECODE_STEPS, vocab] (float32) after its prompt and each teacher token: one prefill
    step of every prompt, then DECODE_STEPS - 1 decode steps."""
    tables = Tables()
    out = [[] for _ in seqs]
    starts = [0] * len(seqs)
    new_tokens = [s[:n].tolist() for s, n in zip(seqs, PROMPT_LENS)]
    for step in range(DECODE_STEPS):
        logits = runner.run(tables.batch(range(len(seqs)), starts, new_tokens))
        for i in range(len(seqs)):
            out[i].append(torch.log_softmax(logits[i].float(), -1))
        starts = [n + step for n in PROMPT_LENS]
        new_tokens = [[s[n + step].item()] for s, n in zip(seqs, PROMPT_LENS)]
    return [torch.stack(rows) for rows in out]


def quantized_projections(runner) -> tuple[types.SimpleNamespace, set[int]]:
    """(torch.nn.functional for the torch backend, except that linear() quantizes the input of runner's FP8
    projections (q|k|v, o, gate|up, down) as the core's block-scaled FP8 GEMM does, at steps of more than GEMV_FP8_MAX_M
    tokens; the data_ptr of each projection whose input it has not quantized yet, which a prefill step empties)."""
    projections = {t.data_ptr() for name, t in runner.weights.items() if name.endswith("_proj")}
    assert projections, f"no projection (a weight named *_proj) among the torch runner's {sorted(runner.weights)}"
    unquantized = set(projections)

    def linear(x, weight, bias=None):
        if len(x) > ops.GEMV_FP8_MAX_M and weight.data_ptr() in projections:
            x = dequantize_activations(*quantize_activations(x)).to(x.dtype)
            unquantized.discard(weight.data_ptr())
        return torch.nn.functional.linear(x, weight, bias)

    return types.SimpleNamespace(**{**vars(torch.nn.functional), "linear": linear}), unquantized


@pytest.mark.parametrize("source", ["transformers' FP8 checkpoint", "quantization='fp8'"])
def test_fp8_runs_as_the_torch_backend_and_transformers(folders, source, monkeypatch):
    from nanograph.backends.cuda_backend import CudaRunner
    from nanograph.backends.torch_backend import TorchRunner

    float_folder, fp8_folder, hf = folders
    folder, quantization = (fp8_folder, None) if source.startswith("transformers") else (float_folder, "fp8")
    mc = ModelConfig.from_pretrained(folder)
    config = Config(model=str(folder), dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                    max_num_batched_tokens=1024, num_kv_blocks=128, block_size=BLOCK, device="cuda",
                    quantization=quantization)
    runner = CudaRunner(config, mc)
    assert runner.weights["layers.0.qkv_proj"].dtype == FP8_DTYPE
    assert runner.weights["layers.0.gate_up_proj_scale"].shape == (2 * 1024 // 8, 512 // 128)
    assert runner.weights["layers.0.gate_up_proj_block_scale"].shape == (2 * 1024 // 128, 4)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, SPEC["vocab_size"], (n + DECODE_STEPS,), generator=gen) for n in PROMPT_LENS]
    ours = teacher_forced_logprobs(runner, seqs)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    # The reference: the same FP8 weights dequantized, float32 throughout; the yardsticks: those weights in a
    # bfloat16 torch forward, and in a float32 one whose prefill projections quantize their activations.
    def torch_runner(dtype):
        return TorchRunner(mc, device="cuda", dtype=dtype, block_size=BLOCK, num_kv_blocks=128, max_model_len=256,
                           quantization=quantization)

    reference, bf16 = (teacher_forced_logprobs(torch_runner(dtype), seqs) for dtype in (torch.float32, torch.bfloat16))
    quantizing = torch_runner(torch.float32)
    functional, unquantized = quantized_projections(quantizing)
    monkeypatch.setattr(torch_backend, "F", functional)
    quantized = teacher_forced_logprobs(quantizing, seqs)
    monkeypatch.undo()
    assert not unquantized, f"{len(unquantized)} projections never saw quantized activations: the yardstick is short"
    for i, (s, n) in enumerate(zip(seqs, PROMPT_LENS)):
        error = (ours[i] - reference[i]).abs()
        bf16_error = (bf16[i] - reference[i]).abs()
        quantized_error = (quantized[i] - reference[i]).abs()
        assert torch.isfinite(ours[i]).all()
        yardstick = bf16_error + quantized_error
        assert error.mean() < 1.5 * yardstick.mean() + 1e-3 and error.max() < max(0.25, 2 * yardstick.max()), (
            f"seq {i}: |dlogprob| against the float32 FP8 reference: mean {error.mean():.4f}, max {error.max():.3f}; "
            f"a bf16 forward's mean {bf16_error.mean():.4f}, with quantized prefill activations "
            f"{quantized_error.mean():.4f}")
        top5 = ours[i].topk(5, -1).indices
        assert (top5 == reference[i].argmax(-1, keepdim=True)).any(-1).all(), f"seq {i}: top-1 outside top-5"
        if quantization is None:  # transformers reads the same FP8 values from its checkpoint
            with torch.no_grad():
                theirs = torch.log_softmax(hf(s[None].cuda()).logits[0].float(), -1)[n - 1:n - 1 + DECODE_STEPS]
            hf_error = (theirs - reference[i]).abs()
            assert hf_error.mean() < 0.01, f"seq {i}: transformers' mean |dlogprob| {hf_error.mean():.4f}"
