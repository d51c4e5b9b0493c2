"""Embeddings on the CUDA core against HF transformers (random bf16 weights, GPU): the final norm's output read from
the core's hidden and residual rows after prefill chunks, pooled LAST, MEAN and CLS; and a classifier's logits and
probabilities against transformers' own classifier."""
import gc
from pathlib import Path

import pytest
import torch

from nanograph import LLM, PoolingParams

from ..hf_models import make_random_model

pytestmark = pytest.mark.gpu

# Prompts of 1 to 700 tokens; max_num_batched_tokens=256 prefills the longest in three chunks. A batch of one-token
# prompts alone runs as a decode step (a graph).
PROMPTS = [list(range(1000, 1700)), [11, 12, 13], [5], list(range(3000, 3300))]
ONE_TOKEN = [[7], [8], [9]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_random_model(str(tmp_path_factory.mktemp("qwen3-2-layers")), "qwen3-0.6b", num_hidden_layers=2,
                             initializer_range=0.04)


@pytest.fixture(scope="module")
def hf_hidden(folder):
    """HF's last hidden states (after the final norm) of each prompt, float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        hidden = [model.model(torch.tensor([p], device="cuda")).last_hidden_state[0].float().cpu()
                  for p in PROMPTS + ONE_TOKEN]
    del model
    torch.cuda.empty_cache()
    return hidden


def cuda_llm(folder, **kwargs) -> LLM:
    """An LLM on the GPU whose prompts run in chunks of 256 tokens."""
    return LLM(folder, device="cuda", num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=256,
               max_num_seqs=8, **kwargs)


def assert_blocks_back(llm: LLM):
    manager = llm.engine.scheduler.block_manager
    assert manager.num_free_blocks == llm.engine.runner.num_kv_blocks


def free_gpu_memory():
    """After the caller dropped its LLM."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embed_on_cuda_matches_transformers(folder, hf_hidden, pooling_type):
    llm = cuda_llm(folder, runner="pooling", pooler_config={"pooling_type": pooling_type})
    try:
        outputs = llm.encode(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
        again = llm.encode(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)  # LAST: from the prefix cache
        outputs += llm.encode(ONE_TOKEN, PoolingParams(normalize=False), use_tqdm=False)
        again += outputs[len(PROMPTS):]
        for hidden, output, repeat in zip(hf_hidden, outputs, again):
            reference = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
            got = output.outputs.data
            assert got.shape == (1024,) and got.dtype == torch.float32
            # bf16 on both sides, the kernels' sums in another order: a few bf16 steps of the largest element.
            assert (got - reference).abs().max() <= 0.05 * reference.abs().max()
            assert torch.nn.functional.cosine_similarity(got, reference, dim=0) > 0.999
            assert torch.nn.functional.cosine_similarity(repeat.outputs.data, got, dim=0) > 0.9999
        if pooling_type == "LAST":
            assert again[0].num_cached_tokens > 0
        assert_blocks_back(llm)
    finally:
        del llm
        free_gpu_memory()


@pytest.fixture(scope="module")
def classifier_folder(folder, tmp_path_factory):
    """The same 2-layer model as a classifier of 4 classes: its body, and a random `score` head (bf16)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("qwen3-classifier")
    config = json.loads((Path(folder) / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], id2label={str(i): f"c{i}" for i in range(4)},
                  label2id={f"c{i}": i for i in range(4)})
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    for file in Path(folder).glob("*.safetensors"):
        tensors.update({name: t for name, t in load_file(file).items() if not name.startswith("lm_head.")})
    generator = torch.Generator().manual_seed(11)
    tensors["score.weight"] = (torch.randn(4, config["hidden_size"], generator=generator) * 0.05).to(torch.bfloat16)
    save_file(tensors, out / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(folder) / name).exists():
            shutil.copy(Path(folder) / name, out / name)
    return str(out)


def test_classify_on_cuda_matches_transformers(classifier_folder):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(classifier_folder, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        reference = [model(torch.tensor([p], device="cuda")).logits[0].float().cpu() for p in PROMPTS + ONE_TOKEN]
    del model
    torch.cuda.empty_cache()
    llm = cuda_llm(classifier_folder)
    try:
        assert llm.engine.pooler.task == "classify"
        probs = llm.classify(PROMPTS + ONE_TOKEN, use_tqdm=False)
        logits = llm.encode(PROMPTS + ONE_TOKEN, PoolingParams(use_activation=False), use_tqdm=False)
        for expected, prob, logit in zip(reference, probs, logits):
            # bf16 logits on HF's side, a float32 head over the bf16 hidden state on ours.
            assert (logit.outputs.data - expected).abs().max() <= 0.05 * expected.abs().max() + 1e-3
            torch.testing.assert_close(torch.tensor(prob.outputs.probs), expected.softmax(-1), atol=0.02, rtol=0)
        assert len({tuple(round(p, 3) for p in output.outputs.probs) for output in probs}) > 1
        assert_blocks_back(llm)
    finally:
        del llm
        free_gpu_memory()
