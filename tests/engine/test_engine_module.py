"""The engine drives any runner through backends/base.Runner: its module names no backend class and probes none of
the runner's attributes."""
import ast
import inspect

from nanograph.backends import cuda_backend, tensor_parallel, torch_backend
from nanograph.backends.base import Runner
from nanograph.engine import llm_engine


def test_the_engine_names_no_backend_and_probes_no_runner_attribute():
    tree = ast.parse(inspect.getsource(llm_engine))
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | \
        {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} | \
        {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not names & {"CudaRunner", "TorchRunner", "cuda_backend", "torch_backend"}
    probes = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("hasattr", "getattr") and "runner" in ast.unparse(node.args[0])]
    assert not probes, [ast.unparse(probe) for probe in probes]
    runner_calls = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "runner"}
    assert runner_calls <= {"forward", "sample", "prompt_logprobs", "pooled_hidden", "shutdown", "num_kv_blocks",
                           "block_size", "kv_cache_summary", "tags_freed", "sleep", "wake_up",
                           "reload_weights", "weights_unread"}, runner_calls
    # Each of them is the base Runner's (sleep mode's included), not one backend's.
    assert all(hasattr(Runner, name) for name in runner_calls - {"num_kv_blocks", "block_size"}), runner_calls


def test_every_backend_is_a_runner():
    for runner_class in (cuda_backend.CudaRunner, torch_backend.TorchRunner, tensor_parallel.TensorParallelRunner):
        assert issubclass(runner_class, Runner) and not inspect.isabstract(runner_class)
