"""benchmarks/decode_timeline.py's arithmetic on hand-made kernel traces (CPU): kernel names, the split into steps,
each kernel's exposed time under overlapping launches, and the table's per-layer roles."""
import io
import json
import os
import subprocess
import sys

import pytest

from benchmarks import decode_timeline as dt


def test_kernel_names_keep_template_arguments_and_drop_the_rest():
    assert dt.kernel_name("void nanograph::(anonymous namespace)::gemv_kernel<8, 8, true, false, true>"
                          "(__nv_bfloat16 const*, __nv_bfloat16 const*, int, (anonymous namespace)::X)") == \
        "gemv_kernel<8, 8, true, false, true>"
    assert dt.kernel_name("void nanograph::stage_metadata_kernel(int4 const*, int4*, int)") == "stage_metadata_kernel"
    assert dt.kernel_name("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn") == \
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn"
    # A parenthesis inside the template arguments is not the parameter list.
    assert dt.kernel_name("void ns::k<(ns::Mode)1, 4>(float*)") == "k<(ns::Mode)1, 4>"


def test_exposed_times_follow_the_latest_end_and_add_up_to_the_span():
    # b starts under a and ends 3 us after it; c ends inside b (PDL: launched early, hidden); d after a gap.
    step = [("a", 0.0, 10.0), ("b", 2.0, 13.0), ("c", 4.0, 12.0), ("d", 15.0, 16.5)]
    exposed = dt.exposed_times(step)
    assert exposed == [10.0, 3.0, 0.0, 3.5]
    assert sum(exposed) == pytest.approx(step[-1][2] - step[0][1])


def test_the_span_runs_to_the_latest_end_not_to_the_last_kernels():
    """The kernel that starts last may end before one that started earlier: the span ends at the latest end, and
    the shares add up to 100%."""
    step = [("a", 0.0, 10.0), ("b", 2.0, 30.0), ("c", 12.0, 14.0)]
    out = io.StringIO()
    dt.summarize({"label": "overlap", "num_layers": 1, "steps": [step]}, out)
    assert "span 30.0 us" in out.getvalue()
    shares = [float(line.split()[-2].rstrip("%")) for line in out.getvalue().splitlines()[2:]]
    assert sum(shares) == pytest.approx(100.0, abs=0.2)


def test_steps_split_where_every_kernel_before_has_ended_long_before():
    kernels = [("a", 0, 10), ("b", 2, 30), ("c", 12, 14),  # c starts after a but inside b: same step
               ("a", 40, 50), ("b", 51, 60), ("a", 100, 101)]
    steps = dt.split_steps(kernels, min_gap_us=5.0)
    assert [[k[0] for k in s] for s in steps] == [["a", "b", "c"], ["a", "b"], ["a"]]


def two_layer_step(t0, gemv_us=(4.0, 2.0)):
    """stage, then per layer: gemv (qkv), attention, gemv (o); then lm_head. Back to back, no overlap."""
    step, t = [], t0
    for name, us in [("stage", 1.0)] + [("gemv", gemv_us[0]), ("attn", 5.0), ("gemv", gemv_us[1])] * 2 + \
            [("lm_head", 20.0)]:
        step.append((name, t, t + us))
        t += us
    return step


def test_the_table_tells_a_kernels_places_in_the_layer_apart():
    timeline = {"label": "toy", "num_layers": 2, "step_us": 42.0,
                "steps": [two_layer_step(0.0), two_layer_step(100.0, (6.0, 2.0)), two_layer_step(200.0)]}
    out = io.StringIO()
    dt.summarize(json.loads(json.dumps(timeline)), out)  # as read back from --json
    rows = {line.split()[0] + (" " + line.split()[1] if line.split()[1].startswith("#") else ""): line.split()
            for line in out.getvalue().splitlines()[3:]}
    assert set(rows) == {"gemv #1/2", "gemv #2/2", "attn", "lm_head", "stage"}
    # gemv #1/2 is the first of each layer's two: 4, 6 and 4 us a call (median 4), 2 calls a step.
    assert rows["gemv #1/2"][2:5] == ["2", "4.00us", "8.0us"]
    assert rows["gemv #2/2"][2:5] == ["2", "2.00us", "4.0us"]
    assert rows["attn"][1:4] == ["2", "5.00us", "10.0us"]
    assert rows["lm_head"][1:4] == ["1", "20.00us", "20.0us"]
    assert "span 43.0 us" in out.getvalue() and "42.0 us a step" in out.getvalue()
    # Sorted by exposed time a step, largest first.
    assert out.getvalue().splitlines()[3].split()[0] == "lm_head"


def test_summarize_from_the_command_line(tmp_path):
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"label": "toy", "num_layers": 2, "steps": [two_layer_step(0.0)]}))
    script = os.path.join(os.path.dirname(dt.__file__), "decode_timeline.py")
    result = subprocess.run([sys.executable, script, "--summarize", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "gemv #1/2" in result.stdout and "1 steps profiled" in result.stdout
