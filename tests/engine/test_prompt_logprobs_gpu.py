"""Prompt logprobs on the CUDA core against HF transformers (random bf16 weights, GPU): prefill chunks longer than a
head slice, and prompt chunks of one token that run as decode steps (graphs) beside a decoding request."""
import gc

import pytest
import torch

from nanograph import LLM, SamplingParams

from ..hf_models import make_random_model

pytestmark = pytest.mark.gpu

MAX_ERROR, MEAN_ERROR = 0.25, 0.03  # |logprob - HF's|, both in bf16 (test_cuda_backend.py's bounds)
SWAP = 2 * MAX_ERROR  # two tokens whose HF logprobs are further apart keep their order


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # initializer_range 0.04: logits spread over a few units, so that ranks and top tokens mean something.
    return make_random_model(str(tmp_path_factory.mktemp("qwen3-2-layers")), "qwen3-0.6b", num_hidden_layers=2,
                             initializer_range=0.04)


def hf_logprobs(folder, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32 on the CPU: row p is HF's distribution of the token after prompt[p]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0].float(), -1).cpu()
    del model
    torch.cuda.empty_cache()
    return logprobs


def generate_on_cuda(folder, calls, **config):
    """The outputs of generate calls (each a list of prompts and a list of params) made in turn on one LLM."""
    llm = LLM(folder, device="cuda", num_kv_blocks=1024, max_model_len=2048, **config)
    try:
        return [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                for prompts, params in calls]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def check_against_hf(prompt_logprobs, reference: torch.Tensor, prompt: list[int], k: int):
    """Values within bf16 tolerance of HF's (as tests/engine/test_cuda_backend.py bounds the sampled logits); the
    prompt token's rank and the top tokens agree wherever the gaps exceed what two such errors can swap."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    errors = []
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        row, target = reference[position - 1], prompt[position]
        errors.append(abs(entry[target].logprob - row[target].item()))
        assert int((row > row[target] + SWAP).sum()) + 1 <= entry[target].rank <= \
            int((row > row[target] - SWAP).sum()) + 1, position
        top = sorted((info.rank, token_id) for token_id, info in entry.items() if info.rank <= k)
        assert [rank for rank, _ in top] == list(range(1, k + 1)), position
        kth = row.topk(k).values[-1].item()
        for _, token_id in top:
            assert row[token_id].item() >= kth - SWAP, position
            errors.append(abs(entry[token_id].logprob - row[token_id].item()))
    assert max(errors) < MAX_ERROR and sum(errors) / len(errors) < MEAN_ERROR, (max(errors), sum(errors) / len(errors))


def test_long_chunks_match_hf(folder):
    """A 1,500-token prompt in chunks of 512 (each more than a head slice of 441 tokens), after a request that
    cached its first blocks (not taken), with graphs captured."""
    prompt = torch.randint(0, 151936, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = hf_logprobs(folder, prompt)
    [warm], [output] = generate_on_cuda(
        folder, [([prompt[:600]], [SamplingParams(max_tokens=1)]),
                 ([prompt], [SamplingParams(max_tokens=4, prompt_logprobs=5)])],
        max_num_batched_tokens=512, max_num_seqs=4)
    assert warm.prompt_logprobs is None and output.num_cached_tokens == 0
    check_against_hf(output.prompt_logprobs, reference, prompt, 5)


def test_one_token_chunks_in_decode_steps_match_hf(folder):
    """A budget of 2 tokens: the prompt goes in one token per step beside another request's decode, so every step
    is a decode step (one token per sequence), replayed from a graph, whose final norm runs in place."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 151936, (40,), generator=generator).tolist()
    other = torch.randint(0, 151936, (1,), generator=generator).tolist()
    reference = hf_logprobs(folder, prompt)
    [[_, output]] = generate_on_cuda(
        folder, [([other, prompt], [SamplingParams(max_tokens=60, ignore_eos=True),
                                    SamplingParams(max_tokens=2, prompt_logprobs=3)])],
        max_num_batched_tokens=2, max_num_seqs=2)
    assert output.outputs[0].token_ids  # the prompt's last step sampled, beside the other request's decode
    check_against_hf(output.prompt_logprobs, reference, prompt, 3)
