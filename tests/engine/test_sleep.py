"""Sleep mode (vLLM's enable_sleep_mode, LLM.sleep / wake_up / is_sleeping) on the torch backend (the default model,
CPU): what sleep frees, the same tokens after wake_up at either level, the prefix cache forgotten, wake_up by tags,
and what is refused (requests while asleep, a sleep with requests unfinished, bad levels and tags)."""
import pytest

from nanograph import LLM, EngineArgs, EngineSleeping, SamplingParams
from nanograph.config import Config

from .tiny_models import make_tiny_classifier, make_tiny_model

# Longer than a KV block (16 tokens), so that the prefix cache keeps them.
PROMPTS = ["Answer in one word, as a geography teacher would to a class of ten year olds: the capital of France is",
           "List three colours that a painter would mix to make the colour of the sea on a grey winter morning:"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=10)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", enable_sleep_mode=True, max_model_len=256, max_num_seqs=4)


def outputs(llm) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for params in (GREEDY, SAMPLED)
            for out in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("level", [1, 2])
def test_the_tokens_after_wake_up_are_the_tokens_before_sleep(llm, level):
    expected = outputs(llm)
    runner = llm.engine.runner
    llm.sleep(level)
    assert llm.is_sleeping()
    assert runner.k_caches is None and runner.v_caches is None
    # On the CPU the weights stay in host memory at level 1 (where they already are) and go at level 2.
    assert (runner.weights is None) == (level == 2)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert outputs(llm) == expected
    assert llm.engine.scheduler.block_manager.num_free_blocks == runner.num_kv_blocks


def test_sleep_forgets_the_prefix_cache(llm):
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    [cached] = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert cached.num_cached_tokens > 0
    llm.sleep(1)
    llm.wake_up()
    [cold] = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == cached.outputs[0].token_ids


def test_requests_are_refused_while_asleep_and_queue_nothing(llm):
    llm.sleep(1)
    try:
        with pytest.raises(EngineSleeping, match=r"asleep, its weights and KV cache freed.*wake_up\(\)"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        with pytest.raises(EngineSleeping):
            llm.engine.add_request(PROMPTS[0], GREEDY)
        assert llm.engine.get_num_unfinished_requests() == 0
        # As in vLLM, sleeping what sleeps already changes nothing (the CPU's level-1 weights stay).
        llm.sleep(2)
        assert llm.engine.runner.weights is not None
        with pytest.raises(EngineSleeping):
            llm.engine.add_request(PROMPTS[0], GREEDY)
    finally:
        llm.wake_up()
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].text


def test_wake_up_by_tags(llm):
    expected = outputs(llm)
    runner = llm.engine.runner
    llm.sleep(2)
    with pytest.raises(ValueError, match=r"'weights', 'kv_cache'"):
        llm.wake_up(["weights", "cache"])
    assert runner.k_caches is None and runner.weights is None  # the refused call changed nothing
    llm.wake_up(["kv_cache"])  # the torch backend's cache does not depend on the weights
    assert runner.weights is None and runner.k_caches is not None
    assert llm.is_sleeping()
    with pytest.raises(EngineSleeping, match="its weights freed"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.wake_up("weights")
    assert not llm.is_sleeping()
    llm.wake_up()  # awake already: nothing to do
    assert outputs(llm) == expected


def test_a_kv_cache_built_over_the_weights_sleeps_and_wakes_with_them(llm, monkeypatch):
    """A runner whose KV cache goes with its weights (the CUDA core's model is built over them, tags_freed): a sleep
    of the weights frees both and their wake_up restores both, as vLLM's tag round trip asks; the KV cache alone
    cannot come back before the weights."""
    expected = outputs(llm)
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "tags_freed", lambda tags: tags | {"kv_cache"} if "weights" in tags else set(tags))
    llm.sleep(tags=["weights"])
    assert runner.weights is None and runner.k_caches is None
    llm.wake_up(["weights"])
    assert not llm.is_sleeping()
    assert outputs(llm) == expected
    llm.sleep(2)
    with pytest.raises(ValueError, match=r"wake the weights first"):
        llm.wake_up(["kv_cache"])
    assert runner.k_caches is None
    llm.wake_up()
    assert outputs(llm) == expected


def count_reads(monkeypatch, runner) -> list:
    """The checkpoint reads of runner (its _load_weights calls), as a list that grows."""
    reads = []
    load = runner._load_weights

    def counted(*args, **kwargs):
        reads.append(args)
        return load(*args, **kwargs)

    monkeypatch.setattr(runner, "_load_weights", counted)
    return reads


def test_level_2_reads_the_checkpoint_once_in_vllms_order_and_in_a_plain_wake_up(llm, monkeypatch):
    """After level 2 the weights come back as memory alone: vLLM's order (weights, reload_weights, KV cache) reads the
    checkpoint once, in reload_weights; a plain wake_up() reads it once, when nothing sleeps any more."""
    expected = outputs(llm)
    runner = llm.engine.runner
    reads = count_reads(monkeypatch, runner)
    llm.sleep(2)
    llm.wake_up(["weights"])
    assert runner.weights is not None and runner.weights_unread and reads == []
    assert runner.weights["lm_head"] is runner.weights["embed_tokens"]  # tied, as loaded
    llm.collective_rpc("reload_weights")
    assert not runner.weights_unread and len(reads) == 1
    llm.wake_up(["kv_cache"])
    assert len(reads) == 1
    assert outputs(llm) == expected
    llm.sleep(2)
    llm.wake_up()
    assert not runner.weights_unread and len(reads) == 2
    assert outputs(llm) == expected
    # Weights slept by tag, the KV cache awake: read as soon as they wake.
    llm.sleep(tags=["weights"])
    llm.wake_up(["weights"])
    assert not runner.weights_unread and len(reads) == 3
    assert outputs(llm) == expected


def test_weights_whose_read_fails_on_wake_up_stay_asleep_until_a_wake_up_reads_them(llm, monkeypatch):
    expected = outputs(llm)
    runner = llm.engine.runner
    load = runner._load_weights

    def unreadable(*args, **kwargs):
        raise OSError("the checkpoint is being rewritten")

    llm.sleep(2)
    monkeypatch.setattr(runner, "_load_weights", unreadable)
    with pytest.raises(OSError, match="being rewritten"):
        llm.wake_up()
    assert llm.is_sleeping() and runner.weights is None  # their memory given back again
    with pytest.raises(EngineSleeping):  # no tokens from weights without values
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.collective_rpc("reload_weights")
    monkeypatch.setattr(runner, "_load_weights", load)
    llm.wake_up(["weights"])
    assert not llm.is_sleeping() and not runner.weights_unread
    assert outputs(llm) == expected


def test_unfinished_requests_are_aborted_or_run_to_their_end(llm):
    """mode="abort" (vLLM's default) ends them with reason "abort"; mode="wait" finishes them first."""
    expected = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    streamed = llm.engine.add_request(PROMPTS[0], GREEDY, stream=True)
    llm.engine.step()
    llm.sleep(1)
    # Ended as abort_request ends a request: a stream's last delta says so.
    assert llm.engine.get_num_unfinished_requests() == 0
    [delta] = [d for d in llm.engine.take_deltas() if d.finished]
    assert (delta.request_id, delta.finish_reason) == (streamed, "abort")
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.runner.num_kv_blocks
    llm.wake_up()
    waited = llm.engine.add_request(PROMPTS[0], GREEDY)
    llm.engine.step()
    llm.sleep(1, mode="wait")
    assert llm.is_sleeping()
    [output] = llm.engine.step()  # finished before the sleep, returned now
    assert (output.request_id, output.outputs[0].token_ids) == (waited, expected)
    assert output.outputs[0].finish_reason != "abort"
    llm.wake_up()
    with pytest.raises(ValueError, match=r"mode must be 'abort' .* or 'wait' .*got 'keep'"):
        llm.sleep(mode="keep")
    assert not llm.is_sleeping()


def test_sleep_by_tags_frees_those_alone(llm):
    expected = outputs(llm)
    runner = llm.engine.runner
    weights = runner.weights
    llm.sleep(tags=["kv_cache"])
    assert runner.k_caches is None and runner.weights is weights
    with pytest.raises(EngineSleeping, match="its KV cache freed"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.wake_up(["kv_cache"])
    assert outputs(llm) == expected
    llm.sleep(tags="weights")  # weights slept by tag keep no copy: read from the checkpoint on wake_up
    assert runner.weights is None and runner.k_caches is not None
    llm.wake_up()
    assert outputs(llm) == expected
    with pytest.raises(ValueError, match=r"sleep tags must be among 'weights', 'kv_cache', got \[\]"):
        llm.sleep(tags=[])


@pytest.mark.parametrize("level", [0, 3, True, "1", None])
def test_levels_other_than_1_and_2_are_refused(llm, level):
    with pytest.raises(ValueError, match=r"level must be 1 .* or 2"):
        llm.sleep(level)
    assert not llm.is_sleeping()


def test_sleep_needs_enable_sleep_mode():
    llm = LLM(device="cpu", max_model_len=128, max_num_seqs=1)
    with pytest.raises(RuntimeError, match=r"enable_sleep_mode=True .*--enable-sleep-mode"):
        llm.sleep()
    assert not llm.is_sleeping()
    assert EngineArgs(enable_sleep_mode=True).create_engine_config().enable_sleep_mode is True
    with pytest.raises(ValueError, match="enable_sleep_mode must be a bool"):
        EngineArgs(enable_sleep_mode="yes").create_engine_config()


def test_a_step_in_flight_for_aborted_requests_does_not_keep_the_engine_awake(llm):
    request_id = llm.engine.add_request(PROMPTS[0], GREEDY)
    llm.engine.step()  # the prompt's step: its first token is on its way
    llm.engine.abort_request(request_id)
    assert not llm.engine.has_unfinished()
    llm.sleep(1)
    llm.wake_up()
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.runner.num_kv_blocks


def test_a_sleep_that_fails_partway_is_asleep_and_wake_up_restores_it(llm, monkeypatch):
    expected = outputs(llm)
    runner = llm.engine.runner

    def failing_sleep(tags, keep_weights):  # the KV cache freed, then a failure before the weights
        runner.k_caches = runner.v_caches = None
        raise MemoryError("no host memory for the weights' copy")

    monkeypatch.setattr(runner, "sleep", failing_sleep)
    with pytest.raises(MemoryError):
        llm.sleep(1)
    monkeypatch.undo()
    assert llm.is_sleeping()
    with pytest.raises(EngineSleeping):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.wake_up()
    assert outputs(llm) == expected


def test_tensor_parallel_engines_refuse_sleep_mode():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 yet: use tensor_parallel_size=1"):
        Config(enable_sleep_mode=True, tensor_parallel_size=2)


def test_reload_weights_reads_the_checkpoint_again_in_place(tmp_path):
    """LLM.collective_rpc("reload_weights") (vLLM's): new weights written over the checkpoint reach the engine without
    a new one; in vLLM's level-2 order (weights awake, reloaded, then the KV cache) too."""
    folder = tmp_path / "model"
    make_tiny_model(folder, "qwen3-tied", seed=0)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(llm):
        return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)

    llm = LLM(str(folder), device="cpu", max_model_len=64, skip_tokenizer_init=True, enable_sleep_mode=True,
              enable_prefix_caching=False)
    old = tokens(llm)
    held = {name: tensor for name, tensor in llm.engine.runner.weights.items()}
    make_tiny_model(folder, "qwen3-tied", seed=1)  # a trainer's new weights, saved where the model was
    new = tokens(LLM(str(folder), device="cpu", max_model_len=64, skip_tokenizer_init=True))
    assert new != old
    assert llm.collective_rpc("reload_weights") == [None]
    assert tokens(llm) == new
    assert all(llm.engine.runner.weights[name] is tensor for name, tensor in held.items())  # in place
    make_tiny_model(folder, "qwen3-tied", seed=0)
    llm.sleep(2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    assert tokens(llm) == old
    with pytest.raises(ValueError, match=r"collective_rpc runs 'reload_weights'; got 'update_weights'"):
        llm.collective_rpc("update_weights")
    llm.sleep(2)
    with pytest.raises(RuntimeError, match=r"the weights are asleep; wake them first"):
        llm.collective_rpc("reload_weights")


def test_a_pooling_engine_sleeps_and_embeds_the_same_after(tmp_path):
    make_tiny_model(tmp_path / "model", "qwen3-tied")
    llm = LLM(str(tmp_path / "model"), device="cpu", max_model_len=64, skip_tokenizer_init=True, runner="pooling",
              enable_sleep_mode=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    expected = [output.outputs.embedding for output in llm.embed(prompts, use_tqdm=False)]
    llm.sleep(2)
    with pytest.raises(EngineSleeping):
        llm.embed(prompts, use_tqdm=False)
    llm.wake_up()
    assert [output.outputs.embedding for output in llm.embed(prompts, use_tqdm=False)] == expected


@pytest.mark.parametrize("how", ["collective_rpc", "level 2"])
def test_reload_weights_reloads_a_classifiers_head(tmp_path, how):
    """collective_rpc("reload_weights"), or the read of the weights that a wake_up after sleep(level=2) makes: the
    classifier's head is read again with the body, from the checkpoint as it is now."""
    folder = tmp_path / "classifier"
    make_tiny_classifier(folder, "qwen3-tied", num_labels=3, seed=0)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}]

    def probs(llm):
        return llm.classify(prompts, use_tqdm=False)[0].outputs.probs

    llm = LLM(str(folder), device="cpu", max_model_len=64, skip_tokenizer_init=True, runner="pooling",
              enable_prefix_caching=False, enable_sleep_mode=True)
    old = probs(llm)
    make_tiny_classifier(folder, "qwen3-tied", num_labels=3, seed=1)
    new = probs(LLM(str(folder), device="cpu", max_model_len=64, skip_tokenizer_init=True, runner="pooling"))
    assert new != old
    if how == "collective_rpc":
        llm.collective_rpc("reload_weights")
    else:
        llm.sleep(2)
        llm.wake_up()
    assert probs(llm) == new
