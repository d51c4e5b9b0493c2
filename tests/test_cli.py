"""The `nanograph` command: chat (one message, or a conversation on stdin, streamed), generate (streamed), bench on a
chosen device, --version, the defaults in --help, and bad values as one error line. The real default model
(SmolLM2-135M-Instruct) runs on the CPU with few output tokens."""
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nanograph
from nanograph import LLM, SamplingParams, cli
from nanograph.cli_stream import chat, read_lines, stream_text
from nanograph.config import Config

from .engine.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 512
NAME_TURNS = ["My name is Ada. Greet me.", "What is my name?"]
SYSTEM = "You are a terse assistant."
REPLY_TOKENS = 8


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def name_replies(llm):
    return greedy_replies(llm, NAME_TURNS, REPLY_TOKENS, SYSTEM)


def run_nanograph(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """The console entry in a fresh interpreter, this checkout's package first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(nanograph.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "nanograph.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=600)


def greedy_replies(llm, user_messages: list[str], max_tokens: int, system_prompt: str | None = None) -> list[str]:
    """Each turn's reply from LLM.chat (not streamed) over the conversation so far."""
    conversation = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    replies = []
    for message in user_messages:
        conversation.append({"role": "user", "content": message})
        [output] = llm.chat(conversation, greedy(max_tokens), use_tqdm=False)
        replies.append(output.outputs[0].text)
        conversation.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_streamed_text_comes_in_pieces_that_make_the_greedy_text(llm):
    prompt = "The three primary colors are"
    writes = []
    text = stream_text(llm, prompt, greedy(REPLY_TOKENS), writes.append)
    [expected] = llm.generate(prompt, greedy(REPLY_TOKENS), use_tqdm=False)
    assert len(writes) > 1
    assert "".join(writes) == text == expected.outputs[0].text


def test_chat_renders_each_turn_over_the_whole_history(llm, name_replies, monkeypatch):
    prompts = []
    stream = llm.stream

    def recording_stream(prompt, params):
        prompts.append(prompt)
        return stream(prompt, params)

    monkeypatch.setattr(llm, "stream", recording_stream)
    writes = []
    conversation = chat(llm, greedy(REPLY_TOKENS), [*NAME_TURNS, "/exit", "never read"], writes.append, SYSTEM)
    replies = name_replies
    assert conversation == [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": NAME_TURNS[0]}, {"role": "assistant", "content": replies[0]},
                            {"role": "user", "content": NAME_TURNS[1]}, {"role": "assistant", "content": replies[1]}]
    assert "".join(writes) == f"{replies[0]}\n{replies[1]}\n"
    assert len(prompts) == 2  # /exit ended the chat
    assert prompts[1] == llm.tokenizer.apply_chat_template(conversation[:4], add_generation_prompt=True,
                                                           tokenize=True, return_dict=False)
    second_prompt = llm.tokenizer.decode(prompts[1])
    assert SYSTEM in second_prompt and NAME_TURNS[0] in second_prompt and replies[0] in second_prompt


def test_a_chat_that_outgrows_max_model_len_says_the_history_is_the_prompt():
    llm = LLM(device="cpu", max_model_len=60)
    writes = []
    with pytest.raises(ValueError) as raised:
        chat(llm, greedy(20), ["Hi there, tell me about Paris please", "And about London and its history please"],
             writes.append)
    assert "prompt has" in str(raised.value) and "max_model_len is 60" in str(raised.value)
    assert str(raised.value).endswith("A turn's prompt is the whole conversation so far (2 of your messages, with the "
                                      "replies): a new chat starts afresh")
    assert "".join(writes).count("\n") == 1  # the first turn was answered


def test_an_empty_line_ends_the_chat(llm):
    writes = []
    assert chat(llm, greedy(2), ["", "never read"], writes.append) == [] and writes == []


def test_a_terminal_is_asked_for_each_line():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    asked = io.StringIO()
    lines = read_lines(Terminal("first\r\nsecond\n"), asked)
    assert next(lines) == "first" and asked.getvalue() == "> "
    assert list(lines) == ["second"] and asked.getvalue() == "> > > \n"  # the last asks before end of input
    assert list(read_lines(io.StringIO("piped\n"), asked)) == ["piped"] and asked.getvalue() == "> > > \n"


def test_interactive_chat_on_stdin_streams_each_reply_with_the_history(name_replies):
    result = run_nanograph("chat", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--max-tokens",
                           str(REPLY_TOKENS), "--system-prompt", SYSTEM, stdin="\n".join(NAME_TURNS) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{name_replies[0]}\n{name_replies[1]}\n"


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_one_prompt_prints_its_streamed_answer(llm, monkeypatch, capsys, command):
    """The prompt argument answers once, with the engine options given; the model is the fixture's."""
    built = {}

    def fixture_llm(model, **kwargs):
        built.update(model=model, **kwargs)
        return llm

    monkeypatch.setattr(cli, "LLM", fixture_llm)
    question = "What is the capital of France?"
    cli.main([command, question, "--device", "cpu", "--max-model-len", "300", "--max-tokens", "10", "--seed", "3"])
    assert built == {"model": None, "device": "cpu", "max_model_len": 300, "seed": 3}
    expected = greedy_replies(llm, [question], 10)[0] if command == "chat" else \
        llm.generate(question, greedy(10), use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"
    if command == "chat":
        assert expected == "The capital of France is Paris."


def test_version_is_the_package_version():
    result = run_nanograph("--version")
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert result.returncode == 0 and result.stdout == f"nanograph {version}\n"


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_help_states_the_sampling_and_engine_defaults(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    model_or = "the model's generation_config.json, else "
    for option, default in [("--temperature TEMPERATURE 0: greedy", model_or + "0.0"),
                            ("--top-p TOP_P", model_or + "1.0"), ("--top-k TOP_K", model_or + "0"),
                            ("--max-tokens MAX_TOKENS", model_or + "256"),
                            ("--max-model-len MAX_MODEL_LEN", Config.max_model_len),
                            ("--device DEVICE", Config.device), ("--seed SEED", Config.seed)]:
        start = text.index(option, text.index("options:"))
        end = text.find(" --", start + 2)
        assert f"(default: {default})" in text[start:end if end > 0 else None], option
    if command == "chat":
        assert "until end of input (Ctrl-D), an empty line or /exit" in text


def test_the_cli_samples_greedily_with_256_tokens_unless_the_model_or_an_option_says_otherwise():
    fields = lambda p: (p.temperature, p.top_p, p.top_k, p.max_tokens, p.repetition_penalty)
    args = cli.build_parser().parse_args(["chat"])
    assert fields(cli.sampling_params(args)) == (0.0, 1.0, 0, 256, 1.0)
    model = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}
    assert fields(cli.sampling_params(args, model)) == (0.6, 0.95, 20, 256, 1.1)
    args = cli.build_parser().parse_args(["chat", "--top-k", "3", "--temperature", "0.3", "--max-tokens", "9"])
    assert fields(cli.sampling_params(args, model)) == (0.3, 0.95, 3, 9, 1.1)


@pytest.fixture(scope="module")
def folder_with_generation_config(tmp_path_factory):
    """The default model's files beside a generation_config.json that asks for 4 new tokens at most and Qwen3's
    sampling."""
    from nanograph.default_model import default_model_path
    folder = tmp_path_factory.mktemp("with_generation_config")
    for source in Path(default_model_path()).iterdir():
        (folder / source.name).symlink_to(source)
    (folder / "generation_config.json").write_text(
        '{"max_new_tokens": 4, "temperature": 0.6, "top_k": 20, "top_p": 0.95}')
    return str(folder)


@pytest.mark.parametrize("options, expected", [
    ([], (0.6, 0.95, 20, 4)),  # the folder's generation_config.json (--generation-config auto)
    (["--temperature", "0", "--max-tokens", "6"], (0.0, 1.0, 0, 6)),  # options given come first (greedy: no top-p/k)
    (["--generation-config", "vllm"], (0.0, 1.0, 0, 256)),  # the command line's own defaults alone
])
def test_generate_samples_as_the_models_generation_config_says(folder_with_generation_config, monkeypatch, capsys,
                                                               options, expected):
    """As vLLM takes a folder's generation_config.json for its default sampling; the command line's own options
    and defaults (greedy, 256 tokens) around it."""
    used = []

    def recording(llm, prompt, params, write):
        used.append(params)
        return stream_text(llm, prompt, params, write)

    monkeypatch.setattr(cli, "stream_text", recording)
    cli.main(["generate", "The capital of France is", "--model", folder_with_generation_config, "--device", "cpu",
              "--max-model-len", "24", "--seed", "1", *options])
    [params] = used
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == expected
    llm = LLM(folder_with_generation_config, device="cpu", max_model_len=24, seed=1)
    [output] = llm.generate("The capital of France is", params, use_tqdm=False)
    assert capsys.readouterr().out == output.outputs[0].text + "\n"
    assert len(output.outputs[0].token_ids) == min(expected[3], 24 - len(output.prompt_token_ids))


@pytest.mark.parametrize("message", ["", "  ", "/exit"])
def test_chat_with_an_empty_message_is_an_error_line(capsys, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["chat", message, "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"nanograph: error: the message {message!r} is empty (or ends a chat): give the message to answer, or " \
           "leave it out to chat on stdin" in err and "Traceback" not in err


def test_a_reader_that_goes_away_ends_generate_without_an_error_line():
    """`nanograph generate ... | head -c 1`: the pipe closes under the stream."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(nanograph.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, "-m", "nanograph.cli", "generate", "Once upon a time", "--device",
                                "cpu", "--max-tokens", "200", "--max-model-len", "256"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    try:
        assert process.stdout.read(1)  # the first piece of text came
        process.stdout.close()
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 1
    assert err.decode() == ""


@pytest.mark.parametrize("argv, message", [
    (["chat", "--top-p", "1.5"], "nanograph: error: top_p must be in (0, 1], got 1.5."),
    (["generate", "hi", "--temperature", "-1"], "nanograph: error: temperature must be non-negative, got -1.0."),
    (["chat", "hi", "--top-k", "-3"], "nanograph: error: top_k must be 0 (disable), or at least 1, got -3."),
    (["generate", "hi", "--max-tokens", "many"],
     "nanograph generate: error: argument --max-tokens: invalid int value: 'many'"),
    (["chat", "hi", "--device", "tpu"], "nanograph: error: unknown device 'tpu'; use auto, cuda, cpu, or "
     "torch:<torch device>"),
    (["bench", "throughput", "--num-seqs", "0"], "nanograph bench: error: argument --num-seqs: '0' is not a positive "
     "integer"),
    (["bench", "latency", "--prompt-len", "-5"], "argument --prompt-len: '-5' is not a positive integer"),
    (["bench", "latency", "--output-len", "0"], "argument --output-len: '0' is not a positive integer"),
    (["bench", "throughput", "--max-input-len", "x"], "argument --max-input-len: 'x' is not a positive integer"),
    (["bench", "serve", "--num-prompts", "-1"], "argument --num-prompts: '-1' is not a positive integer"),
])
def test_a_bad_value_is_one_error_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_a_vllm_command_lines_engine_options_are_taken_or_named(command):
    """vLLM's engine flags parse on every engine command: those nanograph honours become its Config, the others an
    error naming the flag's values (as LLM's keywords are), before any model loads."""
    from nanograph.cli_options import engine_kwargs
    from nanograph.engine_args import engine_config

    argv = [*command, "--swap-space", "4", "--enable-chunked-prefill", "--num-gpu-blocks-override", "64",
            "--block-size", "32", "--max-seq-len-to-capture", "8192", "--disable-custom-all-reduce",
            "--hf-overrides", '{"max_position_embeddings": 512}', "--scheduling-policy", "priority",
            "--guided-decoding-backend", "guidance", "--async-scheduling", "--compilation-config",
            '{"cudagraph_mode": "FULL"}', "--cuda-graph-sizes", "1 2 4", "--disable-cascade-attn"]
    config = engine_config(None, **engine_kwargs(cli.build_parser().parse_args(argv)))
    assert (config.num_kv_blocks, config.block_size, config.scheduling_policy) == (64, 32, "priority")
    assert config.hf_overrides == {"max_position_embeddings": 512}
    for flags, message in [(["--pipeline-parallel-size", "2"], "pipeline_parallel_size=2 is not supported yet: "),
                           (["--enable-lora"], "enable_lora=True is not supported yet: "),
                           (["--speculative-config", '{"method": "ngram"}'], "speculative_config={'method': 'ngram'}"),
                           (["--load-format", "pt"], "use load_format='auto' or 'safetensors'"),
                           (["--guided-decoding-backend", "xgrammar"], "use guided_decoding_backend='auto' or "
                                                                         "'guidance'")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            engine_config(None, **engine_kwargs(cli.build_parser().parse_args([*command, *flags])))


def test_a_config_file_gives_options_that_the_command_line_overrides(tmp_path):
    """vLLM's --config FILE: YAML keys with dashes or underscores, flags as booleans (false for a --no- form),
    lists for several values, mappings as JSON; the command line wins wherever it stands."""
    from nanograph.cli_options import engine_kwargs
    from nanograph.engine_args import engine_config

    config_file = tmp_path / "serve.yaml"
    config_file.write_text("max_model_len: 2048\nserved-model-name: [smol, smol-alias]\nenable-prefix-caching: false\n"
                           "hf_overrides: {rope_theta: 5000.0}\ntrust-remote-code: true\nport: 9000\n"
                           "max-num-seqs: 16\nmodel: some/model\nblock_size: null\n")
    parser = cli.build_parser()
    for argv in (["serve", "--config", str(config_file), "--port", "9001"],
                 ["serve", "--port", "9001", f"--config={config_file}"]):
        args = cli.parse_args(parser, argv)
        assert (args.port, args.served_model_name, args.model) == (9001, ["smol", "smol-alias"], "some/model")
        config = engine_config(None, **engine_kwargs(args))
        assert (config.max_model_len, config.max_num_seqs, config.enable_prefix_caching, config.trust_remote_code,
                config.hf_overrides, config.block_size) == (2048, 16, False, True, {"rope_theta": 5000.0},
                                                            Config.block_size)
    args = cli.parse_args(parser, ["serve", "--max-num-seqs", "4", "--enable-prefix-caching", "--config",
                                   str(config_file)])
    assert (args.max_num_seqs, args.enable_prefix_caching) == (4, True)
    config_file.write_text("max_model_len: 128\ntemperature: 0.5\n")
    args = cli.parse_args(parser, ["generate", "hi", "--config", str(config_file)])
    assert (args.prompt, args.max_model_len, args.temperature) == ("hi", 128, 0.5)
    # Options of several values, and JSON-valued ones given as YAML lists, beside a positional model.
    config_file.write_text("api-key: [secret, other]\nallowed-origins: ['http://page.test']\nmax-model-len: 32k\n"
                           "served-model-name: smol\nseed: -3\nenable-prefix-caching: true\n")
    args = cli.parse_args(cli.build_parser(), ["serve", "/models/m", "--config", str(config_file)])
    assert (args.model, args.model_option, args.api_key, args.allowed_origins, args.max_model_len,
            args.served_model_name, args.seed, args.enable_prefix_caching) == \
        ("/models/m", None, ["secret", "other"], ["http://page.test"], 32000, ["smol"], -3, True)
    # The file's model gives serve its MODEL, which one on the command line replaces.
    config_file.write_text("model: from/file\n")
    for argv, model in ((["serve"], "from/file"), (["serve", "from/command-line"], "from/command-line")):
        args = cli.parse_args(cli.build_parser(), [*argv, "--config", str(config_file)])
        assert (args.model, args.model_option) == (model, None)
    config_file.write_text("uvicorn-log-level: loud\n")
    with pytest.raises(SystemExit):
        cli.parse_args(cli.build_parser(), ["serve", "--config", str(config_file)])


@pytest.mark.parametrize("text, message", [
    ("served-model-name: smol\n", "'served-model-name' is not an option of `nanograph chat`"),
    ("- max_model_len\n", "the file holds a list, not a mapping of option names to values"),
    ("enforce-eager: 1\n", "enforce-eager: a flag takes true or false, not 1"),
    ("max_model_len: [1\n", "--config"),
    ("max_model_len: many\n", "max_model_len: "),
])
def test_a_bad_config_file_is_one_error_line(tmp_path, capsys, text, message):
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["chat", "hi", "--config", str(config_file)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        cli.main(["chat", "hi", "--config", str(tmp_path / "missing.yaml")])
    assert "No such file" in capsys.readouterr().err
    for argv, error in ((["--config", str(config_file), "--config", str(config_file)], "--config is given twice"),
                        (["--conf", str(config_file)], "spell the option out as --config FILE")):
        with pytest.raises(SystemExit):
            cli.main(["chat", "hi", *argv])
        assert error in capsys.readouterr().err


def test_serve_names_an_engine_option_it_cannot_honour_without_loading_the_model():
    result = run_nanograph("serve", "--device", "cpu", "--port", "0", "--pipeline-parallel-size", "2")
    assert result.returncode == 2
    assert "nanograph: error: pipeline_parallel_size=2 is not supported yet" in result.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model(folder, "llama3-untied")
    return str(folder)


@pytest.fixture
def bench_llm_kwargs(monkeypatch):
    """The Config fields the benchmarks build their LLM with (it is built as usual)."""
    import nanograph.bench

    built = {}

    def recording_llm(model, **kwargs):
        built.update(kwargs)
        return LLM(model, **kwargs)

    monkeypatch.setattr(nanograph.bench, "LLM", recording_llm)
    return built


def test_bench_latency_runs_on_the_given_device(tiny, capsys, bench_llm_kwargs):
    cli.main(["bench", "latency", "--model", tiny, "--device", "cpu", "--no-hf", "--prompt-len", "8",
              "--output-len", "4", "--enforce-eager", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert bench_llm_kwargs == {"device": "cpu", "max_model_len": 8 + 4 + 16, "max_num_seqs": 1,
                                "enforce_eager": True, "quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert "nanograph  batch 1, prompt 8, 4 tokens:" in capsys.readouterr().out


def test_bench_latency_compares_with_hf_on_cuda_only(tiny, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "latency", "--model", tiny, "--device", "cpu", "--prompt-len", "8", "--output-len", "4"])
    assert exit_info.value.code == 2
    assert "bench latency compares with HF transformers on CUDA only, and the engine runs on cpu; pass --no-hf" in \
        capsys.readouterr().err


def test_bench_throughput_takes_the_engine_options(tiny, capsys, bench_llm_kwargs):
    cli.main(["bench", "throughput", "--model", tiny, "--device", "cpu", "--num-seqs", "4", "--max-input-len", "16",
              "--max-output-len", "4", "--max-num-seqs", "2", "--no-enable-prefix-caching", "--quantization", "fp8",
              "--kv-cache-dtype", "fp8_e4m3"])
    assert bench_llm_kwargs == {"device": "cpu", "max_model_len": 16 + 4, "max_num_seqs": 2,
                                "enable_prefix_caching": False, "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}
    out = capsys.readouterr().out
    assert "nanograph  4 requests," in out and " tokens in float8_e4m3fn (1 byte per value);" in out
