"""benchmarks/bench_kernels.py's command line: the modules it runs and the -k filters on case labels, and the
names the benchmark scripts put on the import path (CPU)."""
import os
import re
import subprocess
import sys

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


BENCHMARKS = os.path.dirname(bench_kernels.__file__)


def test_every_module_exists():
    folder = os.path.join(BENCHMARKS, "kernel_cases")
    assert sorted(MODULES) == sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py")


def optional_packages_of_transformers():
    """The top-level packages transformers imports when they are installed (its availability checks)."""
    import transformers.utils.import_utils as import_utils
    with open(import_utils.__file__) as f:
        return set(re.findall(r'_is_package_available\(\s*"([A-Za-z0-9_]+)"', f.read()))


def test_no_benchmark_module_shadows_a_package_transformers_imports():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path, so a folder or module there named like a
    package that transformers imports when installed (Hugging Face's `kernels`, say) is found instead of it,
    and importing nanograph fails with an ImportError on every machine where that package is installed."""
    optional = optional_packages_of_transformers()
    assert {"torch", "accelerate"} <= optional  # the checks are found at all
    names = {entry[:-3] if entry.endswith(".py") else entry for entry in os.listdir(BENCHMARKS)
             if entry.endswith(".py") or os.path.isfile(os.path.join(BENCHMARKS, entry, "__init__.py"))}
    assert not names & optional, f"benchmarks/ shadows {sorted(names & optional)}: rename it"


def test_a_benchmark_script_imports_nanograph_from_its_own_folder():
    """Imports nanograph with benchmarks/ first on sys.path, as running a script there does."""
    code = f"import sys; sys.path.insert(0, {BENCHMARKS!r}); import nanograph.llm; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
