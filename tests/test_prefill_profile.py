"""benchmarks/prefill_profile.py's bookkeeping (CPU): kernel names sorted into kinds, their times summed by kind, and
the --shapes argument."""
import argparse

import pytest

from benchmarks import prefill_profile as pp


def test_kernels_are_sorted_into_kinds_by_name():
    names = {
        "void nanograph::(anonymous namespace)::prefill_attention_kernel<128, false, 2>(nanograph::PrefillAttentionArgs, "
        "float)": "prefill attention",
        "void nanograph::(anonymous namespace)::qk_norm_rope_kv_store_kernel<128, true>(nanograph::RopeKvArgs)":
            "QK-norm, RoPE, KV store",
        "nanograph::(anonymous namespace)::silu_mul_kernel(__nv_bfloat16 const*, __nv_bfloat16*, long, int)":
            "SiLU x up",
        "void nanograph::(anonymous namespace)::rmsnorm_kernel<1, true, false>(__nv_bfloat16 const*)": "norms",
        "nvjet_sm90_tst_192x208_64x4_2x1_v_bz_coopB_TNT": "GEMMs",
        "void nanograph::(anonymous namespace)::gemv_kernel<8, 8, false, false, false>(__nv_bfloat16 const*)": "GEMMs",
        "Memset (Device)": "other",
    }
    for name, expected in names.items():
        assert pp.kind(name) == expected, name


def test_times_are_summed_by_kind():
    totals = pp.by_kind({"nvjet_a": 1.0, "nvjet_b": 2.5, "prefill_attention_kernel<64, true, 1>": 0.5,
                         "Memcpy HtoD": 0.25})
    assert totals["GEMMs"] == 3.5 and totals["prefill attention"] == 0.5 and totals["other"] == 0.25
    assert totals["norms"] == 0.0
    assert sum(totals.values()) == 4.25


def test_shapes_are_prompts_by_tokens():
    assert pp.parse_shapes("29x558, 8X2048") == [(29, 558), (8, 2048)]
    for bad in ("29", "0x5", "ax5", "3x"):
        with pytest.raises(argparse.ArgumentTypeError, match="PROMPTSxTOKENS"):
            pp.parse_shapes(bad)
