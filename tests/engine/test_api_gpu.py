"""max_model_len's default on the CUDA core (GPU): the model's own length, capped with a warning by a KV cache that
holds less (the core was built for the full length; a sequence runs to the capped end), and an error naming both
numbers for a length asked for."""
import gc

import pytest

from nanograph import LLM, SamplingParams

from ..hf_models import make_random_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return make_random_model(str(tmp_path_factory.mktemp("qwen3-0.6b")), "qwen3-0.6b")


def test_a_default_length_is_capped_by_the_kv_cache(qwen3_folder):
    engine = dict(num_kv_blocks=40, block_size=16, max_num_seqs=4, dtype="bfloat16")
    with pytest.warns(UserWarning, match="the KV cache holds 640 tokens, fewer than the model's 40960; max_model_len "
                                         "is 640"):
        llm = LLM(qwen3_folder, device="cuda", **engine)
    assert llm.engine.config.max_model_len == 640
    prompt = list(range(1000, 1600))
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"
    del llm
    gc.collect()
    with pytest.raises(ValueError, match="KV cache holds 640 tokens, fewer than max_model_len=1024"):
        LLM(qwen3_folder, device="cuda", max_model_len=1024, **engine)
