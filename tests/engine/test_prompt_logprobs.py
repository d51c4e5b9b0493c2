"""SamplingParams.prompt_logprobs on the torch backend against HF transformers' teacher-forced log-softmax (tiny
random float32 model): chunked prefill, a cached prefix that the request must not take, mixed batches, the limits."""
import numpy as np
import pytest
import torch

from nanograph import LLM, SamplingParams
from nanograph.backends.prompt_logprobs import prompt_logprobs


VOCAB = 256  # tiny_models' vocabulary


@pytest.fixture(scope="module")
def model(qwen3_tied):
    return qwen3_tied


@pytest.fixture(scope="module")
def llm(model):
    # A 7-token budget cuts every prompt into chunks of 7 (or fewer, beside other requests).
    return LLM(str(model[0]), device="cpu", block_size=4, max_num_batched_tokens=7, max_num_seqs=4,
               max_model_len=128)


def hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row p is the distribution of the token after prompt[p], teacher-forced."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_against_hf(prompt_logprobs, hf, prompt: list[int], k: int):
    reference = hf_logprobs(hf, prompt)
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        row, target = reference[position - 1], prompt[position]
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {target, *top}
        assert entry[target].logprob == pytest.approx(row[target].item(), abs=1e-4)
        assert entry[target].rank == int((row > row[target]).sum()) + 1
        for rank, token_id in enumerate(top, start=1):
            if token_id != target:
                assert entry[token_id].rank == rank
            assert entry[token_id].logprob == pytest.approx(row[token_id].item(), abs=1e-4)


def random_prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


@pytest.mark.parametrize("k", [0, 1, 5])
def test_chunked_prefill_gives_hf_prompt_logprobs(llm, model, k):
    prompt = random_prompt(23, seed=k)
    [output] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=k),
                            use_tqdm=False)
    check_against_hf(output.prompt_logprobs, model[1], prompt, k)
    assert output.outputs[0].logprobs is None  # prompt logprobs ask for no sampled-token logprobs


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs_and_cached_for_others(llm, model):
    prompt = random_prompt(30, seed=10)
    block_manager = llm.engine.scheduler.block_manager
    llm.generate({"prompt_token_ids": prompt[:26]}, SamplingParams(max_tokens=1), use_tqdm=False)
    hits = block_manager.num_prefix_hit_tokens
    [output] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=3),
                            use_tqdm=False)
    assert output.num_cached_tokens == 0 and block_manager.num_prefix_hit_tokens == hits
    check_against_hf(output.prompt_logprobs, model[1], prompt, 3)
    # Its blocks were cached once computed: a request without prompt logprobs takes them.
    [plain] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain.num_cached_tokens == 28 and plain.prompt_logprobs is None


def test_a_mixed_batch_gives_each_request_its_own(llm, model):
    prompts = [random_prompt(length, seed=20 + length) for length in (1, 2, 9, 17)]
    params = [SamplingParams(max_tokens=3, prompt_logprobs=2), SamplingParams(max_tokens=3, prompt_logprobs=0),
              SamplingParams(max_tokens=3, logprobs=1),
              SamplingParams(max_tokens=3, prompt_logprobs=4, n=2, temperature=1.0, seed=1)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert outputs[0].prompt_logprobs == [None]
    check_against_hf(outputs[1].prompt_logprobs, model[1], prompts[1], 0)
    assert outputs[2].prompt_logprobs is None
    check_against_hf(outputs[3].prompt_logprobs, model[1], prompts[3], 4)
    assert len(outputs[3].outputs) == 2


def test_all_prompt_logprobs_need_max_logprobs_unlimited(model):
    prompt = random_prompt(6, seed=3)
    limited = LLM(str(model[0]), device="cpu", max_num_seqs=2, max_model_len=64)
    for asked, shown in ((21, "21"), (-1, "all \\(-1\\)")):
        with pytest.raises(ValueError, match=f"prompt_logprobs={shown} is more than max_logprobs=20"):
            limited.generate({"prompt_token_ids": prompt}, SamplingParams(prompt_logprobs=asked), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative or -1, got -2."):
        SamplingParams(prompt_logprobs=-2)
    with pytest.raises(ValueError, match="prompt_logprobs must be an int"):
        SamplingParams(prompt_logprobs=1.5)
    unlimited = LLM(str(model[0]), device="cpu", max_num_seqs=2, max_model_len=64, max_logprobs=-1)
    [output] = unlimited.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=-1),
                                  use_tqdm=False)
    check_against_hf(output.prompt_logprobs, model[1], prompt, VOCAB)


def test_slices_of_tokens_give_what_one_slice_gives():
    torch.manual_seed(0)
    weights = {"norm": torch.rand(16) + 0.5, "lm_head": torch.randn(40, 16)}
    hidden = torch.randn(11, 16)
    targets = torch.randint(0, 40, (11,)).tolist()
    num_top = [3] * 11
    whole = prompt_logprobs(hidden, weights, 1e-6, targets, num_top).result()
    sliced = prompt_logprobs(hidden, weights, 1e-6, targets, num_top, slice_bytes=4 * 40 * 2).result()  # 2 tokens
    for one, other in zip(sliced.logprobs, whole.logprobs):  # a matmul's rounding may vary with its row count
        assert (one.token_ids, one.ranks) == (other.token_ids, other.ranks)
        assert one.logprobs == pytest.approx(other.logprobs, abs=1e-5)
    reference = torch.log_softmax(
        (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * weights["norm"]) @ weights["lm_head"].T, -1)
    for row, (target, token_logprobs) in enumerate(zip(targets, whole.logprobs)):
        assert token_logprobs.token_ids[0] == target
        assert token_logprobs.logprobs[0] == pytest.approx(reference[row, target].item(), abs=1e-5)
        assert token_logprobs.token_ids[1:] == reference[row].topk(3).indices.tolist()


def test_preempted_prompts_keep_each_prompt_logprob_once(model):
    """A KV cache of 16 blocks for three 60-token sequences: prompts are preempted mid-prefill and after it, and
    recomputed; each prompt token's logprobs are still there once, and right."""
    llm = LLM(str(model[0]), device="cpu", block_size=4, num_kv_blocks=16, max_num_batched_tokens=7, max_num_seqs=3,
              max_model_len=64)
    prompts = [random_prompt(40, seed=30 + i) for i in range(3)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=2), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        check_against_hf(output.prompt_logprobs, model[1], prompt, 2)


def test_streams_give_the_prompt_logprobs_on_each_completions_last_delta(llm, model):
    prompt = random_prompt(20, seed=50)
    params = SamplingParams(prompt_logprobs=2, max_tokens=3, n=2, temperature=1.0, seed=1)
    [reference] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    deltas = list(llm.stream([{"prompt_token_ids": prompt}], params))
    last = [delta for delta in deltas if delta.finished]
    assert sorted(delta.index for delta in last) == [0, 1]
    assert all(delta.prompt_logprobs is None for delta in deltas if not delta.finished)
    for delta in last:
        assert delta.prompt_logprobs == reference.prompt_logprobs
    check_against_hf(last[0].prompt_logprobs, model[1], prompt, 2)
    engine = llm.llm_engine
    request_id = engine.add_request({"prompt_token_ids": prompt}, SamplingParams(prompt_logprobs=0, max_tokens=2),
                                    stream=True)
    taken = []
    while engine.has_unfinished_requests():
        engine.step()
        taken += engine.take_deltas()
    [final] = [delta for delta in taken if delta.finished and delta.request_id == request_id]
    check_against_hf(final.prompt_logprobs, model[1], prompt, 0)