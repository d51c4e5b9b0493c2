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
