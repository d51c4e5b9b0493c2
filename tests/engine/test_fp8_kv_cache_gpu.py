"""The FP8 KV cache on the CUDA core (GPU): logprobs and greedy tokens against the core's bf16 cache and against the
torch backend's FP8 cache, a checkpoint's K and V scales, twice the tokens in the same memory, and prefix caching,
preemption and CUDA graphs unchanged.

Random-weight models of real shapes cut to 2 layers and a vocabulary of 8192 (the core runs head_dim 64 and 128 only):
Qwen3 (QK-norm, head_dim 128) and Llama 3.2 (no QK-norm, head_dim 64, GQA 4). Their initializer_range spreads the
logits over a few units (Llama's stays small: without QK-norm its attention scores grow with its square), and keeps
keys and values around 1 to 2 in size: inside e4m3's range at scale 1 (448), above its smallest normal value (2^-6) but
for a few per cent."""
import gc
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nanograph import LLM, SamplingParams
from nanograph.config import Config
from nanograph.model_config import ModelConfig
from nanograph.models.kv_cache import kv_bytes_per_token, load_kv_scales

from ..hf_models import make_random_model
from .test_fp8_kv_cache import E4M3, E4M3_RELATIVE, with_tensors
from .test_llm_gpu import assert_same_or_diverged_at_a_near_tie
from .top5_rule import top5_rule_break

pytestmark = pytest.mark.gpu

MODELS = {"qwen3": ("qwen3-0.6b", 0.06), "llama": ("llama-3.2-1b", 0.02)}  # with their initializer_range
ENGINE = dict(dtype="bfloat16", max_model_len=512, max_num_seqs=16, max_num_batched_tokens=2048, num_kv_blocks=1024,
              skip_tokenizer_init=True)
# Prompt logprobs of every prompt token (the prefill path) and 16 greedy tokens with their top 5 (the decode path).
PARAMS = SamplingParams(temperature=0, max_tokens=16, logprobs=5, prompt_logprobs=0, ignore_eos=True)
# Two bf16 runs of one model, the core against a torch forward: |dlogprob| bounds of test_prompt_logprobs_gpu.py.
BF16_MEAN, BF16_MAX = 0.03, 0.25
# Two FP8 caches fed those bf16 keys and values: where the two differ by a bf16 unit, e4m3 rounds them apart once in 16
# times (its steps are 16 bf16 units) and then by a whole step, which is 4 times the RMS deviation.
FP8_GROWTH = 4
# A checkpoint's scales (llm-compressor's names), powers of two but one: layer 0 keeps keys up to 3.5 (448 x 2^-7)
# and saturates most of its values at 0.4375 (448 x 2^-10); layer 1 saturates most of its keys there and keeps its
# values up to 1344, with subnormals below 0.05.
SCALES = {(0, "k"): 2 ** -7, (0, "v"): 2 ** -10, (1, "k"): 2 ** -10, (1, "v"): 3.0}


def run(folder, prompts, params, **kwargs):
    """The outputs of one generate call on a fresh LLM, and its engine (whose runner holds the KV cache)."""
    llm = LLM(str(folder), **{**ENGINE, **kwargs})
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False), llm.engine
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def random_prompts(n, low, high, seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory):
    """A model folder, twenty prompts, and PARAMS' outputs on the core and on the torch backend (bf16, on the GPU),
    with a bf16 and an FP8 cache: outputs[(device, kv_cache_dtype)]."""
    shape, initializer_range = MODELS[request.param]
    folder = make_random_model(str(tmp_path_factory.mktemp(request.param)), shape, num_hidden_layers=2,
                               vocab_size=8192, initializer_range=initializer_range)
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    prompts = random_prompts(20, 5, 130, seed=0, vocab=vocab)
    outputs = {(device, kv): run(folder, prompts, PARAMS, device=device, kv_cache_dtype=kv)[0]
               for device in ("cuda", "torch:cuda") for kv in ("auto", "fp8")}
    return SimpleNamespace(name=request.param, folder=Path(folder), vocab=vocab, prompts=prompts, outputs=outputs)


def logprob_errors(outputs, expected) -> tuple[torch.Tensor, torch.Tensor]:
    """|dlogprob| of every prompt token but the first (teacher-forced, the prefill path) and of each generated token
    up to the runs' first difference (the decode path); and the expected prompt logprobs."""
    errors, reference = [], []
    for out, ref in zip(outputs, expected, strict=True):
        for i, token in enumerate(ref.prompt_token_ids[1:], start=1):
            reference.append(ref.prompt_logprobs[i][token].logprob)
            errors.append(abs(out.prompt_logprobs[i][token].logprob - reference[-1]))
        ours, theirs = out.outputs[0], ref.outputs[0]
        for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)):
            if a != b:
                break
            errors.append(abs(ours.logprobs[i][a].logprob - theirs.logprobs[i][b].logprob))
    return torch.tensor(errors), torch.tensor(reference)


def test_fp8_moves_the_cores_logprobs_as_e4m3_rounding_does(case):
    """The core with an FP8 cache against its bf16 cache. The keys and values are rounded by at most 2^-4 of their
    size and the attention averages those errors over keys and head dimensions: as on the CPU (test_fp8_kv_cache.py)
    the mean |dlogprob| stays under half that share of the mean |logprob| and none moves by a nat. Everything but the
    cache rounds alike (the same bf16 kernels), so the core's FP8 cache moves its logprobs about as far as the torch
    backend's FP8 cache moves the torch backend's: 1.5 times that, give or take bf16's own difference between them."""
    out = case.outputs
    error, reference = logprob_errors(out["cuda", "fp8"], out["cuda", "auto"])
    torch_error, _ = logprob_errors(out["torch:cuda", "fp8"], out["torch:cuda", "auto"])
    print(f"{case.name}: core FP8 vs bf16 cache |dlogprob| mean {error.mean():.4f} max {error.max():.3f}; "
          f"torch backend's mean {torch_error.mean():.4f} max {torch_error.max():.3f}")
    assert error.mean() > 0  # the cache is e4m3 indeed
    assert error.mean() < E4M3_RELATIVE / 2 * reference.abs().mean(), error.mean()
    assert error.max() < 1.0, error.max()
    assert error.mean() < 1.5 * torch_error.mean() + BF16_MEAN, (error.mean(), torch_error.mean())


def test_fp8_greedy_tokens_follow_the_bf16_cache_by_the_top5_rule(case):
    """At most one prompt in ten may break the rule: random weights leave near-ties of more than five tokens (in bf16
    on the CPU the torch backend broke it for none of 40 prompts of these models, and for one of 40 of a flatter
    Qwen3)."""
    broken = [i for i, (out, ref) in enumerate(zip(case.outputs["cuda", "fp8"], case.outputs["cuda", "auto"],
                                                   strict=True)) if top5_rule_break(out, ref) is not None]
    assert len(broken) <= 0.1 * len(case.prompts), broken


def assert_runs_as_the_torch_backend(outputs, expected, label: str) -> torch.Tensor:
    """The core's FP8 run against the torch backend's (bf16, FP8 cache): greedy tokens by the top-5 rule for every
    prompt, logprobs within bf16's bounds grown by FP8_GROWTH. The |dlogprob|s."""
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert top5_rule_break(out, ref) is None, (label, i)
    error, _ = logprob_errors(outputs, expected)
    print(f"{label}: core vs torch backend, FP8 caches: |dlogprob| mean {error.mean():.4f} max {error.max():.3f}")
    assert error.mean() < FP8_GROWTH * BF16_MEAN and error.max() < FP8_GROWTH * BF16_MAX, (error.mean(), error.max())
    return error


def test_the_cores_fp8_cache_runs_as_the_torch_backends(case):
    assert_runs_as_the_torch_backend(case.outputs["cuda", "fp8"], case.outputs["torch:cuda", "fp8"], case.name)


def test_a_checkpoints_kv_scales_reach_the_core(case, tmp_path):
    """Scales that saturate keys and values: both backends read them from the checkpoint and run alike, and the run
    moves away from the one at scale 1 far more than the backends differ (a core that dropped the scales would run
    as at scale 1)."""
    folder = with_tensors(case.folder, tmp_path / "scaled", {
        f"model.layers.{layer}.self_attn.{kind}_scale": torch.tensor(scale) for (layer, kind), scale in SCALES.items()})
    expected = [[SCALES[layer, "k"], SCALES[layer, "v"]] for layer in range(2)]
    assert load_kv_scales(folder, ModelConfig.from_pretrained(folder)).tolist() == expected
    runs = {device: run(folder, case.prompts, PARAMS, device=device, kv_cache_dtype="fp8")
            for device in ("cuda", "torch:cuda")}
    for device, (_, engine) in runs.items():
        assert engine.runner.kv_scales == expected, device
    error = assert_runs_as_the_torch_backend(runs["cuda"][0], runs["torch:cuda"][0], f"{case.name}, scaled")
    moved, _ = logprob_errors(runs["cuda"][0], case.outputs["cuda", "fp8"])
    print(f"{case.name}: the scales move the core's logprobs by {moved.mean():.4f} on average")
    assert moved.mean() > 3 * error.mean(), (moved.mean(), error.mean())


def test_the_same_memory_holds_twice_the_tokens(case):
    """gpu_memory_utilization sizes the cache from the memory left after the weights and a warm-up step, which the
    cache's dtype does not change: e4m3's 1 byte per value holds twice the blocks of bf16's 2."""
    from nanograph.backends.cuda_backend import CudaRunner

    mc = ModelConfig.from_pretrained(case.folder)
    blocks, summaries = {}, {}
    for kv, dtype in (("auto", torch.bfloat16), ("fp8", E4M3)):
        config = Config(model=str(case.folder), device="cuda", dtype="bfloat16", kv_cache_dtype=kv,
                        gpu_memory_utilization=0.5, enforce_eager=True, max_model_len=512, max_num_seqs=16,
                        max_num_batched_tokens=2048)
        runner = CudaRunner(config, mc)
        assert runner.kv_cache_dtype == dtype
        assert runner.model.kv_bytes_per_block == kv_bytes_per_token(mc, mc.num_kv_heads, dtype) * config.block_size
        blocks[kv], summaries[kv] = runner.num_kv_blocks, runner.kv_cache_summary()
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    assert summaries["fp8"].endswith("tokens in float8_e4m3fn (1 byte per value)"), summaries
    assert summaries["auto"].endswith("tokens in bfloat16 (2 bytes per value)"), summaries
    assert 1.9 * blocks["auto"] <= blocks["fp8"] <= 2.1 * blocks["auto"], blocks


# A run that differs in how the same keys and values were computed (a prefill of other tokens or lengths instead of
# decode steps, other batches) may round a bf16 key by a unit, which an FP8 cache can turn into an e4m3 step (see
# FP8_GROWTH): the greedy tokens agree, or first differ at a near-tie 4 times as wide as test_llm_gpu.py's for bf16.
NEAR_TIE = FP8_GROWTH * 0.05


def test_a_prefix_cache_hit_gives_the_uncached_tokens(case):
    prefix = random_prompts(1, 250, 251, seed=3, vocab=case.vocab)[0]  # 15 full blocks of 16, and 10 tokens
    suffixes = random_prompts(2, 5, 40, seed=4, vocab=case.vocab)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    llm = LLM(str(case.folder), device="cuda", kv_cache_dtype="fp8", **ENGINE)
    try:
        llm.generate([{"prompt_token_ids": prefix + suffixes[0]}], params, use_tqdm=False)
        [cached] = llm.generate([{"prompt_token_ids": prefix + suffixes[1]}], params, use_tqdm=False)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    [plain], _ = run(case.folder, [prefix + suffixes[1]], params, device="cuda", kv_cache_dtype="fp8",
                     enable_prefix_caching=False)
    assert cached.num_cached_tokens == 240 and plain.num_cached_tokens == 0
    assert_same_or_diverged_at_a_near_tie(plain, cached, 0, tolerance=NEAR_TIE)


def test_preempted_requests_give_the_tokens_of_a_roomy_cache(case):
    prompts = random_prompts(12, 20, 120, seed=5, vocab=case.vocab)
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=5, ignore_eos=True)
    roomy, _ = run(case.folder, prompts, params, device="cuda", kv_cache_dtype="fp8", max_model_len=256)
    # 40 blocks of 16 tokens hold about 3 of these sequences at full length: the rest wait or get preempted.
    tight, engine = run(case.folder, prompts, params, device="cuda", kv_cache_dtype="fp8", max_model_len=256,
                        num_kv_blocks=40)
    assert engine.scheduler.num_preemptions > 0
    for i, (r, t) in enumerate(zip(roomy, tight)):
        assert t.finished and len(t.outputs[0].token_ids) == 64
        assert_same_or_diverged_at_a_near_tie(r, t, i, tolerance=NEAR_TIE)


def test_graphs_and_eager_give_the_same_tokens(case):
    """The decode graphs replay the eager kernels on the same cache: the same greedy tokens, bit for bit. All-greedy
    batches take the core's in-step argmax; as requests end at different lengths the batch walks down the buckets."""
    prompts = random_prompts(20, 2, 200, seed=6, vocab=case.vocab)
    gen = torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
              for m in torch.randint(4, 40, (len(prompts),), generator=gen)]
    (graphs, graph_engine), (eager, eager_engine) = (
        run(case.folder, prompts, params, device="cuda", kv_cache_dtype="fp8", enforce_eager=eager)
        for eager in (False, True))
    assert graph_engine.runner.use_graphs and not eager_engine.runner.use_graphs
    for i, (g, e) in enumerate(zip(graphs, eager)):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, f"request {i} differs"
