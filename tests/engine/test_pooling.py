"""Embeddings (runner="pooling") on the torch backend against HF transformers' last hidden states: each pooling type
over prompts prefilled in chunks, the model folder's sentence-transformers pooling, Matryoshka dimensions, a base
model's checkpoint (no "model." prefix, no lm_head), the prefix cache, a recomputed prompt, and the errors."""
import json

import pytest
import torch

from nanograph import LLM, PoolerConfig, PoolingParams, SamplingParams
from nanograph.engine_args import engine_config
from nanograph.pooling import PoolingState

from .tiny_models import make_tiny_model

# Prompts of 1 to 45 tokens: with max_num_batched_tokens=16 the longest are prefilled over three or more steps.
PROMPTS = [list(range(3, 48)), [200, 17, 5, 90, 31], [7], list(range(100, 133))]
TOLERANCE = 1e-5  # float32 on both sides, the same operations in another order


def hf_hidden(model, prompt: list[int]) -> torch.Tensor:
    """HF's last hidden states (after the final norm), [len(prompt), hidden], float32."""
    with torch.no_grad():
        return model.model(torch.tensor([prompt])).last_hidden_state[0].float()


def pooled(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]


def embedding_llm(folder, **kwargs) -> LLM:
    kwargs = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 16, "max_num_seqs": 4,
              "runner": "pooling", **kwargs}
    return LLM(str(folder), **kwargs)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3-untied")
    return folder, make_tiny_model(folder, "llama3-untied", seed=3)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("model_name", ["qwen3", "llama"])
def test_embed_matches_transformers(pooling_type, model_name, qwen3_tied, llama):
    folder, model = qwen3_tied if model_name == "qwen3" else llama
    llm = embedding_llm(folder, pooler_config={"pooling_type": pooling_type})

    def no_sampling(rows, seqs):
        raise AssertionError("a pooling request was sampled")

    llm.engine.runner.sample = no_sampling
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    raw = llm.encode(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
    for prompt, output, unnormalized in zip(PROMPTS, outputs, raw):
        reference = pooled(hf_hidden(model, prompt), pooling_type)
        assert output.prompt_token_ids == prompt and output.finished
        assert output.outputs.hidden_size == model.config.hidden_size
        got = torch.tensor(output.outputs.embedding)
        torch.testing.assert_close(got, torch.nn.functional.normalize(reference, dim=-1), atol=TOLERANCE, rtol=0)
        assert unnormalized.outputs.data.dtype == torch.float32
        torch.testing.assert_close(unnormalized.outputs.data, reference, atol=TOLERANCE * reference.abs().max(),
                                   rtol=0)
    # Every prompt's blocks are back (the prefix cache may keep them, free to take).
    manager = llm.engine.scheduler.block_manager
    assert manager.num_free_blocks == llm.engine.runner.num_kv_blocks


def test_pooling_types_differ(qwen3_tied):
    """The three poolings give three different vectors (no test above passes by pooling one row for all)."""
    folder, _ = qwen3_tied
    vectors = [torch.tensor(embedding_llm(folder, pooler_config=PoolerConfig(pooling_type=kind))
                            .embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding) for kind in ("LAST", "MEAN", "CLS")]
    for i in range(3):
        for j in range(i):
            assert (vectors[i] - vectors[j]).abs().max() > 0.1


def test_sentence_transformers_pooling(tmp_path):
    """modules.json naming a mean Pooling and no Normalize: MEAN, unnormalized, as sentence-transformers pools; a
    pooler_config overrides it."""
    model = make_tiny_model(tmp_path, "qwen3-tied", seed=5)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    hidden = hf_hidden(model, PROMPTS[0])
    llm = embedding_llm(tmp_path)
    assert (llm.engine.pooler.pooling_type, llm.engine.pooler.normalize) == ("MEAN", False)
    got = torch.tensor(llm.embed([PROMPTS[0]], use_tqdm=False)[0].outputs.embedding)
    torch.testing.assert_close(got, hidden.mean(0), atol=TOLERANCE * hidden.abs().max(), rtol=0)
    override = embedding_llm(tmp_path, pooler_config={"pooling_type": "last", "normalize": True})
    got = torch.tensor(override.embed([PROMPTS[0]], use_tqdm=False)[0].outputs.embedding)
    torch.testing.assert_close(got, torch.nn.functional.normalize(hidden[-1], dim=-1), atol=TOLERANCE, rtol=0)
    # A mode nanograph does not pool by is an error naming the override, never another pooling in its place.
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pools by pooling_mode_max_tokens .* pass pooler_config="):
        embedding_llm(tmp_path)
    assert embedding_llm(tmp_path, pooler_config={"pooling_type": "MEAN"}).engine.pooler.pooling_type == "MEAN"


def test_matryoshka_dimensions(qwen3_tied):
    folder, model = qwen3_tied
    plain = embedding_llm(folder)
    with pytest.raises(ValueError, match="request 0: dimensions: this model is not a Matryoshka model"):
        plain.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    llm = embedding_llm(folder, hf_overrides={"is_matryoshka": True})
    outputs = llm.embed(PROMPTS[:2], pooling_params=[PoolingParams(dimensions=16), PoolingParams()], use_tqdm=False)
    reference = hf_hidden(model, PROMPTS[0])[-1]
    assert [output.outputs.hidden_size for output in outputs] == [16, 64]
    torch.testing.assert_close(torch.tensor(outputs[0].outputs.embedding),
                               torch.nn.functional.normalize(reference[:16], dim=-1), atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match=r"dimensions=65 is outside \[1, 64\]"):
        llm.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=65), use_tqdm=False)
    listed = embedding_llm(folder, hf_overrides={"matryoshka_dimensions": [8, 32]})
    with pytest.raises(ValueError, match=r"dimensions=16 is not one the model was trained for; use one of \[8, 32\]"):
        listed.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    assert listed.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=8),
                        use_tqdm=False)[0].outputs.hidden_size == 8


def test_base_model_checkpoint(tmp_path, llama):
    """A checkpoint saved from the base model (as sentence-transformers saves an embedding model): its names lack
    "model." and it holds no lm_head. It pools; generating from it is refused, naming the fix."""
    _, causal = llama
    causal.model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaModel"]
    # runner="auto" (the default) pools a base model's folder, as vLLM does.
    got = embedding_llm(tmp_path, runner="auto").embed(PROMPTS[:2], use_tqdm=False)
    for prompt, output in zip(PROMPTS, got):
        reference = torch.nn.functional.normalize(hf_hidden(causal, prompt)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), reference, atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="without an lm_head .* run it with runner='pooling'"):
        LLM(str(tmp_path), device="cpu", runner="generate")


def test_prefix_cache(qwen3_tied):
    """LAST pooling takes a repeated prompt's blocks from the prefix cache (its last token is always computed);
    MEAN computes every token, and both give the same vectors as the first time."""
    folder, _ = qwen3_tied
    for pooling_type, cached in (("LAST", 32), ("MEAN", 0)):
        llm = embedding_llm(folder, pooler_config={"pooling_type": pooling_type})
        first = llm.encode(PROMPTS[0], use_tqdm=False)[0]
        again = llm.encode(PROMPTS[0], use_tqdm=False)[0]
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, cached), pooling_type
        torch.testing.assert_close(again.outputs.data, first.outputs.data, atol=TOLERANCE, rtol=0)


def test_recomputed_prompt_pools_each_token_once():
    """A prompt computed again from its start (after a preemption) adds to MEAN only the tokens it has not pooled;
    CLS keeps the first token's row, LAST takes the row of the step that completes the prompt."""
    rows = torch.arange(12.0).reshape(6, 2)
    mean = PoolingState(PoolingParams(), "MEAN")
    for start, num_new in ((0, 4), (0, 2), (2, 4)):  # tokens 0-3, then preempted: 0-1 (nothing new), 2-5
        span = mean.rows_to_pool(start, num_new, completes=start + num_new == 6)
        if span:
            mean.add(rows[span.start:span.stop], span.start)
    assert mean.count == 6
    torch.testing.assert_close(mean.result(), rows.mean(0))
    cls, last = PoolingState(PoolingParams(), "CLS"), PoolingState(PoolingParams(), "LAST")
    assert cls.rows_to_pool(0, 4, completes=False) == range(0, 1) and not last.rows_to_pool(0, 4, completes=False)
    cls.add(rows[0:1], 0)
    assert not cls.rows_to_pool(0, 6, completes=True)  # the first token is pooled once
    assert last.rows_to_pool(0, 6, completes=True) == range(5, 6)
    last.add(rows[5:6], 5)
    torch.testing.assert_close(cls.result(), rows[0])
    torch.testing.assert_close(last.result(), rows[5])


def test_truncate_prompt_tokens(qwen3_tied):
    folder, _ = qwen3_tied
    llm = embedding_llm(folder)
    cut = llm.embed(PROMPTS[0], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert cut.prompt_token_ids == PROMPTS[0][-5:]
    assert cut.outputs.embedding == llm.embed(PROMPTS[0][-5:], use_tqdm=False)[0].outputs.embedding


def test_errors(qwen3_tied, tiny_chat_folder):
    folder, _ = qwen3_tied
    llm = embedding_llm(folder)
    with pytest.raises(ValueError, match="request 0: this engine runs the model as an embedding model"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="request 1: dimensions"):  # nothing is queued
        llm.embed(PROMPTS[:2], pooling_params=[PoolingParams(), PoolingParams(dimensions=4)], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="pooling_task='classify'"):
        llm.encode(PROMPTS[:1], pooling_task="classify")
    with pytest.raises(ValueError, match="prompt has 300 tokens"):
        llm.embed([[5] * 300], use_tqdm=False)
    generator = LLM(str(folder), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="build the LLM with runner='pooling'"):
        generator.embed(PROMPTS[:1])
    # The engine still serves after the errors.
    assert len(llm.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding) == 64
    # Text prompts are encoded with the folder's tokenizer.
    chat = embedding_llm(tiny_chat_folder)
    text = chat.embed("The capital of France is", use_tqdm=False)[0]
    assert text.prompt == "The capital of France is"
    assert text.prompt_token_ids == chat.get_tokenizer().encode("The capital of France is")


@pytest.mark.parametrize("kwargs, message", [
    ({"runner": "embed"}, "runner='embed' is not one nanograph has"),
    ({"runner": "generate", "pooler_config": {"pooling_type": "MEAN"}}, "pooler_config is for a pooling model"),
    ({"runner": "pooling", "pooler_config": {"pooling_type": "MAX"}}, "pooling_type='MAX' is not one"),
    ({"runner": "pooling", "pooler_config": {"pooling": "MEAN"}}, r"unknown key\(s\) \['pooling'\]"),
    ({"runner": "generate", "task": "embed"}, "contradicts"),
    ({"runner": "pooling", "task": "generate"}, "contradicts"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine_config(None, **kwargs)


def test_vllm_spellings():
    assert engine_config(None, task="embed").runner == "pooling"
    assert engine_config(None, convert="embed").runner == "pooling"
    assert engine_config(None).runner == "auto"  # settled by the model folder's architecture
    assert engine_config(None, runner="pooling", pooler_config={"pooling_type": "cls"}).pooler_config == \
        PoolerConfig(pooling_type="CLS")
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1 or -1"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="dimensions must be a positive int"):
        PoolingParams(dimensions=0)


def test_score_is_the_cosine_of_the_embeddings(qwen3_tied):
    """LLM.score() on an embedding model, as vLLM's: one text against many, or many against as many in order."""
    folder, _ = qwen3_tied
    llm = embedding_llm(folder)
    vectors = [torch.tensor(output.outputs.embedding) for output in llm.embed(PROMPTS, use_tqdm=False)]

    def cosine(i, j):
        return torch.nn.functional.cosine_similarity(vectors[i], vectors[j], dim=0).item()

    one_to_many = llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
    assert [s.outputs.score for s in one_to_many] == pytest.approx([cosine(0, j) for j in (1, 2, 3)], abs=1e-5)
    assert one_to_many[1].prompt_token_ids == PROMPTS[0] + PROMPTS[2]
    pairwise = llm.score(PROMPTS[:2], PROMPTS[2:], use_tqdm=False)
    assert [s.outputs.score for s in pairwise] == pytest.approx([cosine(0, 2), cosine(1, 3)], abs=1e-5)
    assert abs(llm.score(PROMPTS[3], PROMPTS[3], use_tqdm=False)[0].outputs.score - 1) < 1e-5
    assert len({round(s.outputs.score, 3) for s in one_to_many}) == 3  # the texts differ, and so do their scores
    with pytest.raises(ValueError, match="got 2 and 3"):
        llm.score(PROMPTS[:2], PROMPTS[1:])
