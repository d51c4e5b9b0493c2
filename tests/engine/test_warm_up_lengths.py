"""The CUDA runner's warm-up prefill (CPU): the largest step the scheduler can make, and never a sequence longer than
max_model_len, whose positions would run past the RoPE table and the block tables the core sized for it."""
import pytest

from nanograph.backends.cuda_backend import warm_up_lengths


@pytest.mark.parametrize("max_model_len, max_num_batched_tokens, max_num_seqs", [
    (400, 16384, 1),  # `nanograph bench latency`: one short sequence
    (4096, 16384, 256), (4096, 16384, 2), (1000, 16384, 256), (16384, 16384, 256), (40960, 8192, 256),
    (1, 16, 4), (17, 16, 3), (16, 100, 7),
])
def test_warm_up_sequences_fit_max_model_len_and_fill_the_largest_step(max_model_len, max_num_batched_tokens,
                                                                       max_num_seqs):
    lens = warm_up_lengths(max_model_len, max_num_batched_tokens, max_num_seqs)
    assert 1 <= len(lens) <= max_num_seqs
    assert lens.min() >= 1 and lens.max() <= max_model_len
    assert lens.sum() == min(max_num_batched_tokens, max_num_seqs * max_model_len)
