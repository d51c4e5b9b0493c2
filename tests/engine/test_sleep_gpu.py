"""Sleep mode on the CUDA core (GPU): sleep gives the device memory of the weights and the KV cache back to the driver
(at level 1 the weights wait in pinned host memory), wake_up takes as much again, and the decode graphs captured anew
give the tokens of before, greedy (the argmax inside the step) and sampled, at both levels."""
import gc

import pytest
import torch

from nanograph import LLM, SamplingParams

from ..hf_models import make_random_model

pytestmark = pytest.mark.gpu

PROMPTS = [{"prompt_token_ids": list(range(100, 140))}, {"prompt_token_ids": list(range(500, 520))}]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_random_model(str(tmp_path_factory.mktemp("qwen3-0.6b")), "qwen3-0.6b", num_hidden_layers=4)
    llm = LLM(folder, device="cuda", enable_sleep_mode=True, max_model_len=512, max_num_seqs=4,
              gpu_memory_utilization=0.3)
    yield llm
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def outputs(llm) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for params in (GREEDY, SAMPLED)
            for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_weights_and_the_kv_cache_and_wake_up_gives_the_same_tokens(llm, level):
    runner = llm.engine.runner
    assert runner.use_graphs
    expected = outputs(llm)
    weight_bytes = sum({id(t): t.numel() * t.element_size() for t in runner.weights.values()}.values())
    kv_bytes = runner.num_kv_blocks * runner.model.kv_bytes_per_block
    before = free_bytes()
    llm.sleep(level)
    asleep = free_bytes()
    assert asleep - before >= 0.95 * (weight_bytes + kv_bytes), (asleep - before, weight_bytes, kv_bytes)
    assert (runner._host_weights is not None) == (level == 1)
    if level == 1:
        assert all(t.is_pinned() for t in runner._host_weights.values())
    llm.wake_up()
    # The weights and the KV cache taken again, and no more than before the sleep (the weights come back packed, in
    # one block each: the load at construction had left gaps among them, ~300 MiB more free after a first sleep).
    awake = free_bytes()
    assert asleep - awake >= 0.95 * (weight_bytes + kv_bytes), (asleep - awake, weight_bytes, kv_bytes)
    assert awake >= before - (64 << 20), (awake, before, torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
    assert runner._host_weights is None
    assert outputs(llm) == expected


def test_wake_up_of_the_weights_alone_leaves_the_kv_cache_freed(llm):
    runner = llm.engine.runner
    expected = outputs(llm)
    kv_bytes = runner.num_kv_blocks * runner.model.kv_bytes_per_block
    weight_bytes = sum({id(t): t.numel() * t.element_size() for t in runner.weights.values()}.values())
    llm.sleep(1)
    asleep = free_bytes()
    llm.wake_up(["weights"])
    assert runner.model is None and runner.weights is not None
    # The weights came back, not the KV cache.
    assert 0.95 * weight_bytes <= asleep - free_bytes() < weight_bytes + kv_bytes / 2
    llm.wake_up(["kv_cache"])
    assert outputs(llm) == expected


def test_an_argmax_in_flight_for_an_aborted_request_keeps_nothing_awake(llm):
    """A greedy step's tokens on their way (read from the core's model) when their request is aborted: sleep drops
    them, and the core's model with its KV cache is freed all the same."""
    runner = llm.engine.runner
    kv_bytes = runner.num_kv_blocks * runner.model.kv_bytes_per_block
    request_id = llm.engine.add_request(PROMPTS[0], GREEDY)
    llm.engine.step()
    llm.engine.step()  # a decode step's argmax in flight
    llm.engine.abort_request(request_id)
    before = free_bytes()
    llm.sleep(1)
    assert free_bytes() - before >= 0.95 * kv_bytes
    llm.wake_up()
    assert outputs(llm)[0] == llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_reload_weights_reads_new_weights_into_the_graphs(tmp_path):
    """collective_rpc("reload_weights"): weights saved over the model's folder reach the captured decode graphs (in
    place), giving the tokens of an engine built on them."""
    import shutil

    first = make_random_model(str(tmp_path / "first"), "qwen3-0.6b", seed=0, num_hidden_layers=2)
    second = make_random_model(str(tmp_path / "second"), "qwen3-0.6b", seed=1, num_hidden_layers=2)
    folder = shutil.copytree(first, tmp_path / "served")
    kwargs = dict(device="cuda", max_model_len=256, max_num_seqs=2, num_kv_blocks=64)
    expected = {}
    for name in (first, second):
        other = LLM(name, **kwargs)
        expected[name] = other.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        del other
        gc.collect()
    assert expected[first] != expected[second]
    llm = LLM(str(folder), enable_sleep_mode=True, **kwargs)
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected[first]
    for file in ("model.safetensors", "config.json"):
        shutil.copy(tmp_path / "second" / file, folder / file)
    llm.collective_rpc("reload_weights")
    assert llm.reset_prefix_cache()  # the prompt's cached KV came from the old weights
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected[second]


def test_the_weights_slept_by_tag_take_the_kv_cache_with_them_and_back(llm):
    """On the CUDA core the KV cache (the core's model) is built over the weights: sleep(tags=["weights"]) frees both,
    and wake_up(tags=["weights"]) restores both (vLLM's tag round trip)."""
    runner = llm.engine.runner
    expected = outputs(llm)
    llm.sleep(tags=["weights"])
    assert runner.model is None and runner.weights is None and runner._host_weights is None
    llm.wake_up(["weights"])
    assert not llm.is_sleeping() and runner.model is not None
    assert outputs(llm) == expected


def test_vllms_level_2_order_reads_the_checkpoint_once_into_the_graphs(llm, monkeypatch):
    """After sleep(level=2), vLLM's order (wake_up(["weights"]), collective_rpc("reload_weights"),
    wake_up(["kv_cache"])): the weights come back as memory alone, reload_weights fills that memory in place (the
    addresses the core's model and its graphs keep), and the checkpoint is read once."""
    runner = llm.engine.runner
    expected = outputs(llm)
    reads = []
    load = runner._load_weights
    monkeypatch.setattr(runner, "_load_weights", lambda *args, **kwargs: reads.append(args) or load(*args, **kwargs))
    llm.sleep(2)
    llm.wake_up(["weights"])
    assert runner.weights_unread and reads == []
    addresses = {name: tensor.data_ptr() for name, tensor in runner.weights.items()}
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    assert len(reads) == 1 and not llm.is_sleeping()
    assert {name: tensor.data_ptr() for name, tensor in runner.weights.items()} == addresses
    assert outputs(llm) == expected
