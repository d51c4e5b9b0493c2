"""TorchRunner against HF transformers on tiny random models (float32, CPU): batched prefill, a cached prefix,
decode steps, the RoPE table, and make_runner's choices."""
import numpy as np
import pytest
import torch

import nanograph
from nanograph.backends import make_runner, resolve_dtype
from nanograph.backends.torch_backend import TorchRunner
from nanograph.config import Config
from nanograph.engine.batch import ForwardBatch
from nanograph.model_config import ModelConfig
from nanograph.models import rope_cos_sin

from .tiny_models import TINY_CONFIGS, make_tiny_model

BLOCK = 4
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(folder, request.param)
    return hf, ModelConfig.from_pretrained(folder)


def new_runner(mc):
    return TorchRunner(mc, block_size=BLOCK, num_kv_blocks=64, max_model_len=128)


def forward_batch(steps):
    """steps: one (block_table, num_cached_tokens, new_token_ids) per sequence."""
    assert all(len(table) * BLOCK >= start + len(new) for table, start, new in steps), "block table too short"
    new_lens = [len(new) for _, _, new in steps]
    positions = np.concatenate([np.arange(start, start + len(new)) for _, start, new in steps])
    seq_of_token = np.repeat(np.arange(len(steps)), new_lens)
    block_tables = np.zeros((len(steps), max(len(table) for table, _, _ in steps)), dtype=np.int32)
    for row, (table, _, _) in zip(block_tables, steps):
        row[:len(table)] = table
    return ForwardBatch(
        input_ids=np.concatenate([new for _, _, new in steps]).astype(np.int32),
        input_src=np.full(sum(len(new) for _, _, new in steps), -1, dtype=np.int32),
        positions=positions.astype(np.int32),
        slot_mapping=(block_tables[seq_of_token, positions // BLOCK] * BLOCK + positions % BLOCK).astype(np.int32),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32),
        context_lens=np.array([start + len(new) for _, start, new in steps], dtype=np.int32),
        block_tables=block_tables,
        is_decode=all(n == 1 for n in new_lens))


def hf_logits(hf, tokens) -> torch.Tensor:
    """Logits of every position of one sequence, computed by transformers in one pass."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_batched_prefill_matches_hf(pair):
    hf, mc = pair
    runner = new_runner(mc)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, mc.vocab_size, n).tolist() for n in (5, 17, 33)]
    tables = [[7, 15], [3, 12, 0, 9, 30], [1, 2, 4, 5, 6, 8, 10, 11, 13]]  # scattered, non-contiguous blocks
    logits = runner.run(forward_batch([(t, 0, p) for t, p in zip(tables, prompts)]))
    assert logits.dtype == torch.float32 and logits.shape == (3, mc.vocab_size)
    for row, prompt in zip(logits, prompts):
        torch.testing.assert_close(row, hf_logits(hf, prompt)[-1], **TOL)


def test_cached_prefix_then_decode_matches_hf(pair):
    hf, mc = pair
    runner = new_runner(mc)
    rng = np.random.default_rng(1)
    a = rng.integers(0, mc.vocab_size, 30).tolist()
    b = rng.integers(0, mc.vocab_size, 9).tolist()
    table_a, table_b = [20, 5, 17, 2, 11, 8, 14, 1, 25], [9, 30, 4]
    # chunked prefill: a's first 13 tokens, then its last 17 beside b's whole prompt
    runner.run(forward_batch([(table_a, 0, a[:13])]))
    logits = runner.run(forward_batch([(table_a, 13, a[13:]), (table_b, 0, b)]))
    torch.testing.assert_close(logits[0], hf_logits(hf, a)[-1], **TOL)
    torch.testing.assert_close(logits[1], hf_logits(hf, b)[-1], **TOL)
    for _ in range(3):
        a.append(int(logits[0].argmax()))
        b.append(int(logits[1].argmax()))
        batch = forward_batch([(table_a, len(a) - 1, a[-1:]), (table_b, len(b) - 1, b[-1:])])
        assert batch.is_decode
        logits = runner.run(batch)
        torch.testing.assert_close(logits[0], hf_logits(hf, a)[-1], **TOL)
        torch.testing.assert_close(logits[1], hf_logits(hf, b)[-1], **TOL)


def test_rope_table_matches_hf_rotary_embedding(pair):
    hf, mc = pair
    table = rope_cos_sin(mc, 200)
    positions = torch.arange(200)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    half = mc.head_dim // 2
    torch.testing.assert_close(table, torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1), rtol=0, atol=0)


def test_rope_scaling_reaches_the_table(pair):
    _, mc = pair
    rope_type = mc.hf_config.rope_parameters["rope_type"]
    plain_cos = torch.cos(torch.arange(100.0)[:, None] / mc.hf_config.rope_parameters["rope_theta"]
                          ** (torch.arange(0, mc.head_dim, 2) / mc.head_dim))
    differs = not torch.allclose(rope_cos_sin(mc, 100)[:, :mc.head_dim // 2], plain_cos, atol=1e-5)
    assert differs == (rope_type != "default"), rope_type


def test_make_runner_cpu_and_auto(pair):
    _, mc = pair
    # "auto" falls back to the torch backend only where the core sees no GPU.
    for device in ("cpu",) if nanograph.gpu_available() else ("cpu", "auto"):
        config = Config(model=mc.path, device=device, max_model_len=64, max_num_seqs=3)
        runner = make_runner(config, mc)
        assert isinstance(runner, TorchRunner) and runner.device.type == "cpu"
        assert runner.weights["embed_tokens"].dtype == torch.float32
        assert runner.num_kv_blocks == 3 * 64 // config.block_size
    runner = make_runner(Config(model=mc.path, device="torch:cpu", dtype="bfloat16", num_kv_blocks=5), mc)
    assert runner.num_kv_blocks == 5 and runner.k_caches[0].dtype == torch.bfloat16


def test_dtype_names_are_vllms(tmp_path):
    make_tiny_model(tmp_path, "qwen2-tied")
    mc, cpu = ModelConfig.from_pretrained(tmp_path), torch.device("cpu")
    names = {"float": torch.float32, "float32": torch.float32, "half": torch.float16, "float16": torch.float16,
             "bfloat16": torch.bfloat16, "auto": torch.float32}
    assert {name: resolve_dtype(name, mc, cpu) for name in names} == names
    with pytest.raises(ValueError, match="unknown dtype 'double'; use auto, float32"):
        resolve_dtype("double", mc, cpu)


def test_make_runner_rejects_unknown_device(pair):
    _, mc = pair
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        make_runner(Config(model=mc.path, device="tpu"), mc)


def test_tokens_of_slot_minus_one_store_nothing(pair):
    """A token whose slot is -1 (warm-ups, benchmarks) stores no key or value: the cache's last slot, which a
    negative index would name, keeps what it held, and the step's other tokens are stored as usual."""
    _, mc = pair
    runner = new_runner(mc)
    rng = np.random.default_rng(3)
    for caches in (runner.k_caches, runner.v_caches):
        for cache in caches:
            cache.copy_(torch.randn_like(cache))
    before = [c.clone() for c in runner.k_caches + runner.v_caches]
    batch = forward_batch([([6, 2], 0, rng.integers(0, mc.vocab_size, 5).tolist())])
    batch.slot_mapping[[1, 3]] = -1
    runner.run(batch)
    stored = batch.slot_mapping[batch.slot_mapping >= 0]
    for old, new in zip(before, runner.k_caches + runner.v_caches):
        flat_old, flat_new = old.view(-1, *old.shape[2:]), new.view(-1, *new.shape[2:])
        untouched = np.setdiff1d(np.arange(len(flat_old)), stored)
        assert torch.equal(flat_new[untouched], flat_old[untouched]), "a slot outside the step's slots changed"
        assert not torch.equal(flat_new[stored], flat_old[stored]), "the stored tokens' keys and values are missing"
