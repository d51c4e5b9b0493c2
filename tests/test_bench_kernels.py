"""benchmarks/bench_kernels.py's command line: the modules it runs and the -k filters on case labels (CPU)."""
import pytest

from benchmarks import bench_kernels
from benchmarks.bench_kernels import MODULES, parse_args, selected


def test_no_arguments_run_every_module_and_case():
    assert parse_args([]) == (MODULES, [])
    assert selected("decode_attn 1x32768 q32/kv8 hd128 bs16", [])


def test_modules_and_filters():
    modules, filters = parse_args(["decode_attention", "gemv", "-k", "1x32768", "-k", "8B gate_up"])
    assert modules == ["decode_attention", "gemv"]
    assert filters == ["1x32768", "8B gate_up"]
    assert selected("decode_attn 1x32768 fp8 q32/kv8 hd128 bs16", filters)
    assert selected("gemv 8B gate_up M=1 N=24576 K=4096", filters)
    assert not selected("decode_attn 4x16384 q32/kv8 hd128 bs16", filters)
    assert not selected("gemv 8B gate_UP M=1", filters)  # case-sensitive


def test_an_unknown_module_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        parse_args(["decode_atention"])
    err = capsys.readouterr().err
    assert "decode_atention" in err and "decode_attention" in err


def test_every_module_exists():
    import os
    folder = os.path.join(os.path.dirname(bench_kernels.__file__), "kernels")
    assert sorted(MODULES) == sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py")
