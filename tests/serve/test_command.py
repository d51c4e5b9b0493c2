"""`nanograph serve` without the serve extra says how to install it; its arguments reach the engine's Config."""
import sys

import pytest

from nanograph.cli import main


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn", "prometheus_client"])
def test_a_missing_server_package_names_the_install_command(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as if it were not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--device", "cpu"])
    assert str(exit_info.value) == (f"nanograph serve needs the {missing} package, which is not installed: "
                                    "pip install 'nanograph[serve]'")


def test_an_invalid_engine_argument_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--gpu-memory-utilization", "1.5", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "gpu_memory_utilization must be in (0, 1], got 1.5." in capsys.readouterr().err


def test_quantization_and_kv_cache_dtype_reach_the_config():
    from nanograph.cli import build_parser
    from nanograph.cli_options import engine_kwargs

    args = build_parser().parse_args(["serve", "MODEL", "--quantization", "fp8", "--kv-cache-dtype", "auto"])
    assert engine_kwargs(args) == {"quantization": "fp8", "kv_cache_dtype": "auto"}


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-dtype", "fp8_e5m2"], "kv_cache_dtype='fp8_e5m2' is not supported yet: nanograph's KV cache holds "
                                       "the model's dtype or FP8 e4m3; use kv_cache_dtype='auto'"),
    (["--quantization", "gptq"], "quantization='gptq' is not supported yet: nanograph runs FP8 weights"),
])
def test_an_unsupported_quantization_or_kv_cache_dtype_is_one_error_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv, "--device", "cpu"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_setting_the_cuda_core_lacks_is_one_error_line():
    """The engine process refuses tensor parallelism on the CUDA core before it touches a GPU: the server exits with
    that one line, not a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--device", "cuda", "--tensor-parallel-size", "2"])
    assert str(exit_info.value).startswith("nanograph serve: NotImplementedError: tensor_parallel_size=2 is not "
                                           "implemented on the CUDA core yet")


def test_cors_flags_take_json_lists_of_strings(capsys):
    from nanograph.cli import build_parser

    args = build_parser().parse_args(["serve", "--allowed-origins", '["http://localhost:3000"]'])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == \
        (["http://localhost:3000"], ["*"], ["*"], False)
    for bad in ("http://localhost:3000", '"*"', "[1]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--allowed-origins", bad])
        assert "argument --allowed-origins" in capsys.readouterr().err


def test_vllms_engine_flags_reach_the_config():
    from nanograph.cli import build_parser
    from nanograph.cli_options import engine_kwargs

    args = build_parser().parse_args([
        "serve", "--model", "MODEL", "--max-num-batched-tokens", "512", "--max-logprobs", "5", "--tokenizer", "TOK",
        "--revision", "v1", "--download-dir", "/hub", "--generation-config", "vllm", "--trust-remote-code",
        "--served-model-name", "a", "b", "--uvicorn-log-level", "warning", "--response-role", "bot",
        "--root-path", "/api", "--disable-log-stats", "--disable-log-requests"])
    assert engine_kwargs(args) == {"max_num_batched_tokens": 512, "max_logprobs": 5, "tokenizer": "TOK",
                                   "revision": "v1", "download_dir": "/hub", "generation_config": "vllm",
                                   "trust_remote_code": True}
    assert (args.model, args.model_option, args.served_model_name, args.uvicorn_log_level) == \
        (None, "MODEL", ["a", "b"], "warning")
    assert (args.response_role, args.root_path, args.disable_log_stats, args.disable_log_requests) == \
        ("bot", "/api", True, True)


def test_two_different_models_are_one_error_line():
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "ONE", "--model", "TWO", "--device", "cpu"])
    assert str(exit_info.value) == "nanograph serve: two models given, 'ONE' and --model 'TWO'; give one"


def test_a_model_taken_as_a_served_name_is_one_error_line(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--served-model-name", "a", str(tmp_path), "--device", "cpu"])
    assert str(exit_info.value).startswith(f"nanograph serve: --served-model-name took ['{tmp_path}'] as names too; "
                                           "give the model first")


def test_the_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    from nanograph.serve.command import read_chat_template

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "template.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "template.jinja")) == template
    assert read_chat_template(template) == template and read_chat_template(None) is None
    assert read_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"  # as vLLM reads it
    with pytest.raises(SystemExit, match="--chat-template 'no/such/file.jinja' is not a file, nor a template"):
        read_chat_template("no/such/file.jinja")


def test_the_servers_chat_template_renders_requests_that_bring_none():
    """--chat-template replaces the tokenizer's for every request; a request's own still needs
    --trust-request-chat-template."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from nanograph.default_model import default_model_path
    from nanograph.serve.errors import APIError
    from nanograph.serve.protocol import ChatCompletionRequest
    from nanograph.serve.serving import ServedModel

    info = SimpleNamespace(model=default_model_path(), max_model_len=512, sampling_defaults={}, tokenizer=None,
                           reasoning_parser=None, runner="generate",
                           pooling_task=None, labels=(), score_activation=None)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    served = ServedModel(SimpleNamespace(info=info), ["smol", "alias"], tokenizer, chat_template=template)
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert served.render_chat_now(request.messages, request) == tokenizer.encode("[user] hi\n", add_special_tokens=False)
    served.check_model("alias")
    with pytest.raises(APIError, match="this server serves `smol`, `alias`"):
        served.check_model("other")
    own = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "chat_template": "{{ messages[0].content }}"})
    with pytest.raises(APIError, match="needs a server started with --trust-request-chat-template"):
        served.render_chat_now(own.messages, own)


def test_the_content_format_flag_reaches_the_servers_rendering(capsys):
    """--chat-template-content-format: "auto" gives a template that loops over a content its text parts; "string"
    the joined string (a loop then meets characters); another value is argparse's error."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from nanograph.cli import build_parser
    from nanograph.default_model import default_model_path
    from nanograph.serve.protocol import ChatCompletionRequest
    from nanograph.serve.serving import ServedModel

    assert build_parser().parse_args(["serve"]).chat_template_content_format == "auto"
    assert build_parser().parse_args(["serve", "--chat-template-content-format", "string"]) \
        .chat_template_content_format == "string"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template-content-format", "parts"])
    assert "invalid choice: 'parts'" in capsys.readouterr().err
    info = SimpleNamespace(model=default_model_path(), max_model_len=512, sampling_defaults={}, tokenizer=None,
                           reasoning_parser=None, runner="generate",
                           pooling_task=None, labels=(), score_activation=None)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    template = "{% for m in messages %}[{{ m.role }}]{% for part in m.content %}{{ part.text }};{% endfor %}{% endfor %}"
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    rendered = {}
    for content_format in ("auto", "string"):
        served = ServedModel(SimpleNamespace(info=info), "smol", tokenizer, chat_template=template,
                             content_format=content_format)
        rendered[content_format] = tokenizer.decode(served.render_chat_now(request.messages, request))
    assert rendered == {"auto": "[user]hi;", "string": "[user];;"}


def test_vllms_spellings_of_numbers_and_flags(monkeypatch):
    """Token counts as 32k / 32K, options with underscores, several API keys (an empty one left out at serve time),
    and vLLM's logging and app flags."""
    from nanograph.cli import build_parser, dashed_options
    from nanograph.cli_options import engine_kwargs, human_readable_int

    assert [human_readable_int(text) for text in ("4096", "32k", "25.6k", "32K", "1m", "2M", " 8k ", "1.001k")] == \
        [4096, 32000, 25600, 32768, 10 ** 6, 2 * 2 ** 20, 8000, 1001]
    for bad in ("1.5K", "32kb", "k", "4096.0"):
        with pytest.raises(Exception, match="whole number|binary suffix"):
            human_readable_int(bad)
    argv = dashed_options(["serve", "MODEL", "--max_model_len", "32K", "--max_num_batched_tokens=2k",
                           "--api_key", "one", "two", "--enable-log-requests", "--disable-uvicorn-access-log",
                           "--enable-request-id-headers", "--disable-fastapi-docs"])
    args = build_parser().parse_args(argv)
    assert engine_kwargs(args) == {"max_model_len": 32768, "max_num_batched_tokens": 2000}
    assert args.api_key == ["one", "two"] and args.disable_log_requests and args.disable_uvicorn_access_log
    assert args.enable_request_id_headers and args.disable_fastapi_docs
    assert dashed_options(["generate", "--", "--not_an_option"]) == ["generate", "--", "--not_an_option"]
    monkeypatch.delenv("NANOGRAPH_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == ["from-env"]
    monkeypatch.setenv("NANOGRAPH_API_KEY", "ours")
    assert build_parser().parse_args(["serve"]).api_key == ["ours"]


def test_a_model_taken_as_an_api_key_is_one_error_line(tmp_path):
    for model in (str(tmp_path), "Qwen/Qwen3-0.6B"):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--api-key", "k", model, "--device", "cpu"])
        assert str(exit_info.value).startswith(f"nanograph serve: --api-key took ['{model}'] as keys too; give the "
                                               "model first")


def test_default_chat_template_kwargs_take_a_json_object(capsys):
    from nanograph.cli import build_parser

    args = build_parser().parse_args(["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    for bad, message in (("[1]", "is not a JSON object"), ("{enable_thinking: false}", "not JSON")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--default-chat-template-kwargs", bad])
        assert message in capsys.readouterr().err
