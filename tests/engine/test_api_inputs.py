"""What a user hands the LLM API and the CLI, on tiny random models (CPU): vLLM's prompt dicts, wrong types, chat()
without a tokenizer, the tokenizer's end-of-text token, YaRN's scaled context (against HF transformers), rope types
that are refused, and CLI errors as one line instead of a traceback."""
import json

import pytest
import torch

from nanograph import LLM, SamplingParams
from nanograph.cli import main

from .tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-tied")
    make_tiny_model(folder, "qwen3-tied")
    return folder, LLM(str(folder), device="cpu", max_model_len=128, num_kv_blocks=32, block_size=16)


def tokens(outputs):
    return [out.outputs[0].token_ids for out in outputs]


def test_vllm_prompt_dicts_equal_their_plain_forms(tiny):
    _, llm = tiny
    ids = [5, 17, 33, 2]
    plain = tokens(llm.generate([ids], GREEDY, use_tqdm=False))
    assert tokens(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)) == plain
    assert tokens(llm.generate([{"prompt_token_ids": ids}, ids], GREEDY, use_tqdm=False)) == plain * 2
    # vLLM's TokensPrompt may carry its text: the ids are generated from, the text is reported.
    [out] = llm.generate({"prompt": "hi", "prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert out.prompt == "hi" and out.prompt_token_ids == ids and tokens([out]) == plain
    with pytest.raises(ValueError, match=r"multi_modal_data is not supported: nanograph's models take text only"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": object()}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"got unknown key\(s\) \['prompt_ids'\]"):
        llm.generate({"prompt_ids": ids}, GREEDY, use_tqdm=False)


def test_wrong_argument_types_say_what_is_accepted(tiny):
    _, llm = tiny
    with pytest.raises(TypeError, match="prompts must be a string, a list of token ids, a dict"):
        llm.generate(7, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, or a list of them"):
        llm.generate([[1, 2]], {"temperature": 0}, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_chat_without_a_tokenizer_names_what_is_missing(tiny):
    _, llm = tiny
    with pytest.raises(ValueError, match="chat\\(\\) needs the model folder's tokenizer, and this folder has none"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY)


def save_word_tokenizer(folder, eos_token: str):
    """A tokenizer of whole words over ids 0..9 (ids 0-2 special), saved into folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eot>": 1, "<end>": 2, **{f"w{i}": i for i in range(3, 10)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eos_token, pad_token="<pad>").save_pretrained(folder)


def test_the_tokenizers_end_of_text_token_ends_a_completion(tmp_path):
    """config.json names one end token (a base model's), the tokenizer another (a fine-tune's): both end a
    completion, as in vLLM."""
    make_tiny_model(tmp_path, "qwen3-tied")
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_word_tokenizer(tmp_path, eos_token="<end>")
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, num_kv_blocks=8, block_size=16)
    assert llm.engine.stop_checker.eos_token_ids == {1, 2}


@pytest.mark.slow
def test_yarn_serves_its_scaled_context_as_hf_does(tmp_path):
    """max_position_embeddings 64 with YaRN x4 (Qwen2.5's long-context recipe): max_model_len 256 is taken as asked,
    and a 200-token prompt gives HF transformers' greedy tokens."""
    hf = make_tiny_model(tmp_path, "qwen2-yarn-short")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=32, block_size=16)
    assert llm.engine.config.max_model_len == 256
    prompt = [(7 * i + 3) % 256 for i in range(200)]
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, 200:].tolist()
    assert out.outputs[0].token_ids == expected


def test_longrope_is_refused_by_name(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
                         intermediate_size=96, max_position_embeddings=256,
                         rope_scaling={"rope_type": "longrope", "long_factor": [2.0] * 8, "short_factor": [1.0] * 8,
                                       "original_max_position_embeddings": 64}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--model", "/nonexistent/folder"], "model folder '/nonexistent/folder' does not exist"),
    (["chat", "hi", "--model", "TINY"], "chat needs a tokenizer, and the model folder has none: .* --tokenizer"),
    (["generate", "hi", "--model", "TINY"], "generate needs a tokenizer .* --tokenizer"),
    (["generate", "hi", "--model", "TINY", "--seed", str(2**70)], r"seed must be in \[0, 2\*\*64\)"),
])
def test_cli_errors_are_one_line(argv, message, tiny, capsys):
    folder, _ = tiny
    argv = [str(folder) if arg == "TINY" else arg for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert any(line.startswith("nanograph") and "error:" in line for line in err.splitlines())
    import re
    assert re.search(message, err)


def test_chat_errors_of_the_template_or_the_text_are_value_errors_naming_them(tmp_path, capsys):
    """A template that refuses a system message, and a message holding a lone surrogate, fail LLM.chat with a
    ValueError that says so (as vLLM's), and the chat command with one line, not a traceback."""
    make_tiny_model(tmp_path, "qwen3-tied")
    save_word_tokenizer(tmp_path, eos_token="<end>")
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                         "{{ raise_exception('System role not supported') }}{% endif %}"
                                         "{{ m['content'] }} {% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, num_kv_blocks=8, block_size=16)
    params = SamplingParams(max_tokens=2)
    assert llm.chat([{"role": "user", "content": "w1 w2"}], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="could not render the messages: TemplateError: System role not supported"):
        llm.chat([{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="a chat message is not valid UTF-8 text: .*lone surrogate"):
        llm.chat([{"role": "user", "content": "w1 caf\udce9"}], params, use_tqdm=False)
    for extra, message in ([["--system-prompt", "w1"], "System role not supported"],
                           [[], "not valid UTF-8 text"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["chat", "w1 caf\udce9" if not extra else "w2", "--model", str(tmp_path), "--device", "cpu",
                  "--max-model-len", "64", *extra])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and message in err


def test_a_torch_dtype_is_taken_by_its_name(tiny):
    folder, _ = tiny
    llm = LLM(str(folder), device="cpu", dtype=torch.bfloat16, max_model_len=64, num_kv_blocks=8, block_size=16)
    assert llm.engine.config.dtype == "bfloat16"
    with pytest.raises(ValueError, match="unsupported dtype torch.int8"):
        LLM(str(folder), device="cpu", dtype=torch.int8)


def test_chat_takes_text_parts_and_chat_template_kwargs(tmp_path):
    make_tiny_model(tmp_path, "qwen3-tied")
    save_word_tokenizer(tmp_path, eos_token="<end>")
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                                         "{% if enable_thinking is defined and not enable_thinking %}w9{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, num_kv_blocks=8, block_size=16)
    plain = llm.chat([{"role": "user", "content": "w3 w4"}], GREEDY, use_tqdm=False)[0]
    # Parts are joined by a newline (vLLM's rule): run together, "w3" and "w4" would be one unknown word.
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w3"}, {"type": "text", "text": "w4"}]}],
                     GREEDY, use_tqdm=False)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids == [3, 4]
    off = llm.chat([{"role": "user", "content": "w3 w4"}], GREEDY, use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})[0]
    assert off.prompt_token_ids == [3, 4, 9]
    with pytest.raises(ValueError, match="text content parts only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], GREEDY)
