"""Tensor parallelism on the torch backend (CPU, gloo, 2 processes): the shards load_weights reads, the engine's
outputs against tensor_parallel_size=1 (greedy, seeded, chunked prefill with prefix caching and preemption, KV
heads replicated, an FP8 KV cache, the real SmolLM2, embeddings and a classifier), bad sizes, and a worker that dies or
hangs."""
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from nanograph import LLM, SamplingParams, cli
from nanograph.backends import make_runner
from nanograph.backends.tensor_parallel import TensorParallelRunner
from nanograph.backends.step_broadcast import FIRST_INTS, receive_step, send_step
from nanograph.cli_options import engine_kwargs
from nanograph.config import Config
from nanograph.engine.batch import ForwardBatch
from nanograph.model_config import ModelConfig
from nanograph.models import load_weights
from nanograph.models.sharding import Shard

from .tiny_models import TINY_CONFIGS, make_tiny_model
from .top5_rule import assert_top5_rule

# A cache of 12 blocks of 4 tokens and a step budget of 16 tokens: prompts are chunked, shared prefixes are cached,
# and six sequences at once outgrow the cache, so some are preempted.
SMALL = dict(device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=12, max_model_len=48,
             max_num_seqs=6, max_num_batched_tokens=16)
PREFIX = [11, 23, 35, 47, 59, 71, 83, 95, 107]
PROMPTS = [PREFIX + [i, 2 * i + 1] for i in range(1, 7)] + [[200, 3, 9, 41, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]


def shutdown_leaves_no_worker(llm):
    pids = llm.llm_engine.runner.worker_pids
    llm.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # ended and reaped
            os.kill(pid, 0)


def assert_same_outputs(ours, reference, atol=1e-4):
    """Equal tokens, each with its logprob (and the top logprobs) equal to float32 rounding."""
    for out, ref in zip(ours, reference, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for mine, theirs in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            for token, logprob in theirs.items():
                assert mine[token].logprob == pytest.approx(logprob.logprob, abs=atol)


def workload():
    """Greedy, then seeded sampling, each row with its top 3 logprobs."""
    greedy = SamplingParams(temperature=0, max_tokens=9, logprobs=3)
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=9, logprobs=3)
              for i in range(len(PROMPTS))]
    return [(PROMPTS, greedy), (PROMPTS, seeded)]


SHARD_CASES = [(name, {}, 2) for name in TINY_CONFIGS] + [
    ("qwen3-tied", {}, 4),  # 2 KV heads over 4 ranks: each holds the one its query heads read
    ("qwen2-tied", {}, 4),  # the same with a qkv bias
    ("qwen3-tied", dict(num_attention_heads=6, num_key_value_heads=3, intermediate_size=90), 2),  # as SmolLM2: uneven
]


@pytest.mark.parametrize("name, overrides, world", SHARD_CASES,
                         ids=[f"{name}-{'uneven' if o else 'even'}-{world}" for name, o, world in SHARD_CASES])
def test_each_rank_loads_its_slice_and_the_slices_make_the_whole(tmp_path, name, overrides, world):
    """Column-parallel qkv (whole heads, each rank's query heads those of its KV heads) and gate|up, row-parallel
    o_proj and down_proj, the embedding by vocabulary rows, norms whole, lm_head on rank 0 alone."""
    make_tiny_model(tmp_path, name, config_overrides=overrides)
    mc = ModelConfig.from_pretrained(tmp_path)
    whole = load_weights(tmp_path, mc, torch.float32, "cpu")
    shards = [load_weights(tmp_path, mc, torch.float32, "cpu", Shard(rank, world)) for rank in range(world)]
    hd, group, inter = mc.head_dim, mc.num_heads // mc.num_kv_heads, mc.intermediate_size

    def heads(tensor, count):
        return tensor.view(count, hd, *tensor.shape[1:])

    for key, tensor in whole.items():
        if key.endswith(("qkv_proj", "qkv_bias")):
            q, k, v = (heads(t, len(t) // hd) for t in tensor.split([mc.num_heads * hd] + [mc.num_kv_heads * hd] * 2))
            parts = []
            for s in shards:
                nkv = 1 if mc.num_kv_heads < world else len(s[key]) // hd // (group + 2)
                nq = len(s[key]) // hd - 2 * nkv
                parts.append([heads(t, len(t) // hd) for t in s[key].split([nq * hd, nkv * hd, nkv * hd])])
            assert torch.equal(torch.cat([p[0] for p in parts]), q)
            if mc.num_kv_heads >= world:
                assert torch.equal(torch.cat([p[1] for p in parts]), k)
                assert torch.equal(torch.cat([p[2] for p in parts]), v)
                assert all(len(p[0]) == group * len(p[1]) >= group for p in parts)
            else:  # rank r's query heads are r * (heads / world) onwards; their KV head is the first's group
                for rank, p in enumerate(parts):
                    kv_head = rank * (mc.num_heads // world) // group
                    assert torch.equal(p[1], k[kv_head:kv_head + 1]) and torch.equal(p[2], v[kv_head:kv_head + 1])
        elif key.endswith("gate_up_proj"):
            halves = [s[key].chunk(2) for s in shards]
            assert torch.equal(torch.cat([gate for gate, _ in halves]), tensor[:inter])
            assert torch.equal(torch.cat([up for _, up in halves]), tensor[inter:])
        elif key.endswith(("o_proj", "down_proj")):
            assert torch.equal(torch.cat([s[key] for s in shards], dim=1), tensor)
        elif key == "embed_tokens":
            assert torch.equal(torch.cat([s[key] for s in shards]), tensor)
        elif key == "lm_head":
            assert torch.equal(shards[0][key], tensor) and all(key not in s for s in shards[1:])
        else:
            assert all(torch.equal(s[key], tensor) for s in shards)


class RecordedBroadcasts:
    """Rank 0's broadcasts recorded, then replayed to a receiving rank, in one process."""

    def __init__(self):
        self.sent, self.replaying = [], False

    def broadcast(self, tensor, root, timeout):
        assert root == 0
        if self.replaying:
            tensor.copy_(self.sent.pop(0))
        else:
            self.sent.append(tensor.clone())
        return self

    def wait(self):
        pass


def replayed(batch):
    """What a worker receives of send_step(batch), and how many broadcasts it took."""
    group = RecordedBroadcasts()
    send_step(group, batch, timedelta(seconds=1))
    count, group.replaying = len(group.sent), True
    arrived = receive_step(group, timedelta(days=1), timedelta(seconds=1))
    assert not group.sent
    return arrived, count


@pytest.mark.parametrize("num_seqs, tokens_per_seq, broadcasts", [(3, 1, 1), (5, 7, 1), (40, 30, 1), (40, 40, 2)])
def test_the_step_metadata_arrives_whole(num_seqs, tokens_per_seq, broadcasts):
    """(40, 30): 4,045 ints, within FIRST_INTS; (40, 40): 5,285, past it, so a second broadcast."""
    rng = np.random.default_rng(num_seqs)
    num_tokens, max_blocks = num_seqs * tokens_per_seq, 9

    def ints(*shape):
        return rng.integers(0, 1 << 30, shape, dtype=np.int32)

    batch = ForwardBatch(input_ids=ints(num_tokens), input_src=np.full(num_tokens, -1, np.int32),
                         positions=ints(num_tokens), slot_mapping=ints(num_tokens), cu_seqlens_q=ints(num_seqs + 1),
                         context_lens=ints(num_seqs), block_tables=ints(num_seqs, 2 * max_blocks)[:, :max_blocks],
                         is_decode=tokens_per_seq == 1)
    size = 4 + 3 * num_tokens + 2 * num_seqs + 1 + num_seqs * max_blocks
    assert (size > FIRST_INTS) == (broadcasts == 2)
    arrived, sent = replayed(batch)
    assert sent == broadcasts
    assert arrived.is_decode == batch.is_decode
    for field in ("input_ids", "input_src", "positions", "slot_mapping", "cu_seqlens_q", "context_lens",
                  "block_tables"):
        assert np.array_equal(getattr(arrived, field), getattr(batch, field)), field
    assert replayed(None) == (None, 1)  # the stop message


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-tied")
    make_tiny_model(folder, "qwen3-tied")
    return folder


@pytest.fixture(scope="module")
def reference(tiny_folder):
    llm = LLM(str(tiny_folder), **SMALL)
    return [llm.generate(prompts, params, use_tqdm=False) for prompts, params in workload()]


@pytest.fixture(scope="module")
def tp_llm(tiny_folder):
    llm = LLM(str(tiny_folder), **SMALL, tensor_parallel_size=2)
    yield llm
    llm.shutdown()


def test_outputs_equal_one_rank_with_chunking_prefix_caching_and_preemption(tp_llm, reference):
    scheduler = tp_llm.llm_engine.scheduler
    preemptions = scheduler.num_preemptions
    for (prompts, params), expected in zip(workload(), reference):
        outputs = tp_llm.generate(prompts, params, use_tqdm=False)
        assert_same_outputs(outputs, expected)
        assert any(out.num_cached_tokens for out in outputs)
    assert scheduler.num_preemptions > preemptions
    assert scheduler.block_manager.num_free_blocks == SMALL["num_kv_blocks"]


def test_prompt_logprobs_equal_one_rank(tp_llm, tiny_folder):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    [ours] = tp_llm.generate([PROMPTS[-1]], params, use_tqdm=False)
    [theirs] = LLM(str(tiny_folder), **SMALL).generate([PROMPTS[-1]], params, use_tqdm=False)
    for mine, ref in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True):
        assert mine.keys() == ref.keys()
        assert all(mine[t].logprob == pytest.approx(ref[t].logprob, abs=1e-4) for t in ref)


def test_an_fp8_kv_cache_gives_the_outputs_of_one_rank(tiny_folder):
    """Each rank stores its own heads with the layer's per-tensor K and V scales, as one rank stores them all."""
    prompts, greedy = workload()[0]
    expected = LLM(str(tiny_folder), **SMALL, kv_cache_dtype="fp8").generate(prompts, greedy, use_tqdm=False)
    llm = LLM(str(tiny_folder), **SMALL, kv_cache_dtype="fp8", tensor_parallel_size=2)
    assert llm.llm_engine.runner.kv_cache_dtype == torch.float8_e4m3fn
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    shutdown_leaves_no_worker(llm)
    assert_same_outputs(outputs, expected)


def test_a_worker_killed_mid_generation_fails_the_engine_with_the_rank_named(tiny_folder):
    tp_llm = LLM(str(tiny_folder), **SMALL, tensor_parallel_size=2)  # its own: this test ends it
    engine = tp_llm.llm_engine
    request_id = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    [pid] = engine.runner.worker_pids
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert time.monotonic() - start < 10
    [output] = outputs
    assert output.request_id == request_id and output.outputs[0].finish_reason == "abort"
    assert f"tensor parallel rank 1 (pid {pid}) exited with code -9" in output.error
    with pytest.raises(RuntimeError, match="tensor parallel rank 1 .* exited"):
        tp_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    shutdown_leaves_no_worker(tp_llm)


def test_fewer_kv_heads_than_ranks_are_replicated_and_a_hung_worker_times_out(tmp_path):
    """One KV head (untied lm_head) over 2 ranks: each holds it. An engine idle for longer than the step timeout
    still runs; a worker that stops answering ends the engine within about that timeout."""
    make_tiny_model(tmp_path, "llama3-untied", config_overrides=dict(num_key_value_heads=1))
    prompts, params = workload()[0]
    expected = LLM(str(tmp_path), **SMALL).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tmp_path), **SMALL, tensor_parallel_size=2, tensor_parallel_step_timeout=2)
    assert llm.llm_engine.runner.rank0.k_caches[0].shape[2] == 1
    assert_same_outputs(llm.generate(prompts, params, use_tqdm=False), expected)
    time.sleep(2.5)
    assert llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    [pid] = llm.llm_engine.runner.worker_pids
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Timed out .*; no worker rank exited, so one may hang or be slower than "
                                           r"tensor_parallel_step_timeout \(2 s\)"):
        llm.generate(prompts, params, use_tqdm=False)
    assert time.monotonic() - start < 8
    shutdown_leaves_no_worker(llm)


def test_a_worker_that_fails_to_start_is_an_error_naming_its_rank(tiny_folder, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the worker process exits with code 1 at once
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor parallel rank 1 \(pid \d+\) exited with code 1 while starting"):
        LLM(str(tiny_folder), **SMALL, tensor_parallel_size=2)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["chat"]])
def test_the_command_line_takes_vllms_tensor_parallel_size_option(command):
    args = cli.build_parser().parse_args([*command, "--tensor-parallel-size", "2"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 2


@pytest.mark.parametrize("size", [0, -2, 1.5, "2", True])
def test_a_bad_tensor_parallel_size_is_a_value_error_naming_it(size):
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        Config(tensor_parallel_size=size)


@pytest.mark.parametrize("size", [3, 8])
def test_kv_heads_that_cannot_be_shared_evenly_are_a_value_error(tiny_folder, size):
    """4 query heads, 2 KV heads: 3 ranks cannot share 2 KV heads, 8 ranks cannot share 4 query heads."""
    with pytest.raises(ValueError, match=rf"tensor_parallel_size \({size}\) is more than num_key_value_heads \(2\).*"
                                         r"num_attention_heads \(4\); use a tensor_parallel_size of at most 2"):
        LLM(str(tiny_folder), device="cpu", tensor_parallel_size=size)


def test_the_cuda_core_refuses_tensor_parallelism_naming_the_torch_backend(tiny_folder):
    config = Config(model=str(tiny_folder), device="cuda", tensor_parallel_size=2)
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2 .*torch backend.*device='cpu'"):
        make_runner(config, ModelConfig.from_pretrained(tiny_folder))


@pytest.mark.slow
def test_smollm2_greedy_generations_agree_with_one_rank_by_the_top5_rule():
    """The real model: equal tokens, or at the first difference each side's token is in the other's top 5."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    expected = LLM(device="cpu", max_model_len=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(device="cpu", max_model_len=128, tensor_parallel_size=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    shutdown_leaves_no_worker(llm)
    with pytest.raises(RuntimeError, match=r"the engine was shut down \(LLM.shutdown\(\)\)"):
        llm.generate(prompts[:1], params, use_tqdm=False)
    assert_top5_rule(outputs, expected)


def test_an_interrupted_step_ends_the_workers_at_once_and_later_steps_fail(tiny_folder, monkeypatch):
    """Ctrl-C inside a step leaves the workers inside its collectives: they are killed, not told to stop (the message
    would meet their all-reduce and wait for the step timeout)."""
    llm = LLM(str(tiny_folder), **SMALL, tensor_parallel_size=2)
    runner = llm.llm_engine.runner
    pids = runner.worker_pids

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.rank0, "forward", interrupted)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert time.monotonic() - start < 10
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="a step was interrupted"):
        llm.llm_engine.runner.forward(None, [])


def test_an_engine_that_fails_after_its_runner_is_built_ends_the_workers(tiny_folder, monkeypatch):
    """max_model_len beyond what the KV cache holds is an error raised once the runner (and its workers) exist."""
    started = []
    real_init = TensorParallelRunner.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.extend(self.worker_pids)

    monkeypatch.setattr(TensorParallelRunner, "__init__", recording_init)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_folder), **{**SMALL, "num_kv_blocks": 2}, tensor_parallel_size=2)
    assert started
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bench_sweep_refuses_tensor_parallelism(tiny_folder):
    from nanograph.bench_sweep import sweep

    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported there: leave it at 1"):
        sweep(str(tiny_folder), [1], [16], tensor_parallel_size=2, device="cpu")


def test_pooling_equals_one_rank(tiny_folder, tmp_path):
    """Embeddings (mean pooling over chunked prompts) and a classifier's probabilities on two ranks: rank 0's final
    hidden states give the vectors one rank gives."""
    from nanograph import PoolingParams

    from .tiny_models import make_tiny_classifier

    prompts = [PREFIX + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8]]
    for folder, method, kwargs in ((tiny_folder, "encode", {"runner": "pooling",
                                                            "pooler_config": {"pooling_type": "MEAN"}}),
                                   (tmp_path, "classify", {})):
        if method == "classify":
            make_tiny_classifier(tmp_path, "qwen3-tied", num_labels=3, seed=4)
        params = {"pooling_params": PoolingParams(normalize=False)} if method == "encode" else {}
        expected = getattr(LLM(str(folder), **SMALL, **kwargs), method)(prompts, use_tqdm=False, **params)
        llm = LLM(str(folder), **SMALL, **kwargs, tensor_parallel_size=2)
        outputs = getattr(llm, method)(prompts, use_tqdm=False, **params)
        shutdown_leaves_no_worker(llm)
        for ours, theirs in zip(outputs, expected, strict=True):
            got, want = (torch.tensor(o.outputs.probs) if method == "classify" else o.outputs.data
                         for o in (ours, theirs))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert want.abs().max() > 0.01
