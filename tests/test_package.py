"""The package imports everywhere; without a GPU (or without the core) GPU calls raise clear errors."""
import pytest

import nanograph


def test_import_reports_the_core():
    assert isinstance(nanograph.core_available(), bool)
    assert nanograph.core_available() == (nanograph.CORE_ERROR is None)


@pytest.mark.skipif(nanograph.gpu_available(), reason="this checks the no-GPU path")
def test_gpu_kernel_without_gpu_raises_a_clear_error():
    import nanograph.ops as ops

    with pytest.raises(RuntimeError, match="no CUDA GPU is visible|core is not available"):
        ops.rmsnorm


@pytest.mark.skipif(nanograph.gpu_available(), reason="this checks the no-GPU path")
def test_cuda_device_without_gpu_raises_a_clear_error(tmp_path):
    from tests.hf_models import make_random_model

    folder = make_random_model(str(tmp_path / "m"), "qwen3-0.6b", num_hidden_layers=1, hidden_size=64,
                               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, vocab_size=256)
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible|core is not available"):
        nanograph.LLM(folder, device="cuda")
