"""`nanograph bench sweep` and `nanograph bench plot`: every (batch, context) point measured or skipped with its
reason, the roofline bytes against a count from the model's config, the PNG and its lines, and bad values as clear
errors. On CPU with tiny random models; the GPU test runs the core's decode graphs on a model of real shape."""
import json
import sys
from pathlib import Path

import pytest

from nanograph import cli
from nanograph.bench_plot import plot_file, plot_sweep
from nanograph.bench_sweep import sweep

from .engine.tiny_models import make_tiny_model
from .hf_models import make_random_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BLOCK = 16


@pytest.fixture(scope="module", params=["qwen3-tied", "llama3-untied"])
def tiny(request, tmp_path_factory):
    """A tied model with q/k norms and an untied one, for the byte count."""
    folder = tmp_path_factory.mktemp(request.param)
    make_tiny_model(folder, request.param)
    return str(folder)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_tiny_model(folder, "llama3-untied")
    return str(folder)


@pytest.fixture(scope="module")
def swept(tiny, tmp_path_factory):
    """A sweep whose KV cache (6 blocks of 16 tokens) cannot hold 2 sequences of 64 tokens."""
    output = tmp_path_factory.mktemp("sweep") / "sweep.json"
    result = sweep(tiny, [2, 1], [64, 16], output=str(output), steps=2, device="cpu", num_kv_blocks=6,
                   block_size=BLOCK)
    return result, output


def config_step_bytes(folder: str, batch: int, context: int, dtype_bytes: int = 4) -> int:
    """What one decode step must move, counted from config.json: every weight once (an untied embedding table
    not at all), the batch's embedding rows and logits, K and V of every context token in every layer."""
    c = json.loads(open(f"{folder}/config.json").read())
    hidden, layers, heads, kv_heads = (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                                       c["num_key_value_heads"])
    head_dim = c.get("head_dim") or hidden // heads
    per_layer = (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden  # qkv, o
                 + 3 * hidden * c["intermediate_size"] + 2 * hidden)  # gate, up, down; the two norms
    if c["model_type"] == "qwen3":
        per_layer += 2 * head_dim  # q_norm, k_norm
    weights = layers * per_layer + hidden + c["vocab_size"] * hidden  # final norm, lm_head
    rows = batch * (hidden + c["vocab_size"])
    kv = batch * context * 2 * layers * kv_heads * head_dim
    return (weights + rows + kv) * dtype_bytes


def test_sweep_measures_every_point_or_says_why_not(tiny, swept):
    result, output = swept
    assert json.loads(output.read_text()) == result
    assert result["model"] == tiny and result["device"].startswith("cpu") and result["dtype"] == "float32"
    assert result["runner"] == "TorchRunner" and result["num_kv_blocks"] == 6 and result["block_size"] == BLOCK
    assert result["max_num_seqs"] == 2 and result["max_model_len"] == 64 and result["copy_gbs"] > 0
    points = {(p["batch"], p["context"]): p for p in result["points"]}
    assert [(p["batch"], p["context"]) for p in result["points"]] == [(1, 16), (2, 16), (1, 64), (2, 64)]
    assert points[2, 64] == {"batch": 2, "context": 64,
                             "skipped": "needs 8 KV blocks of 16 tokens; the KV cache holds 6"}
    for (batch, context), point in points.items():
        if (batch, context) == (2, 64):
            continue
        assert "skipped" not in point
        assert point["ms_per_step"] > 0 and point["ms_per_token"] == point["ms_per_step"]
        assert point["tokens_per_s"] == pytest.approx(batch / (point["ms_per_step"] / 1e3))
        assert point["roofline_bytes"] == config_step_bytes(tiny, batch, context)
        assert point["roofline_ms"] == pytest.approx(point["roofline_bytes"] / (result["copy_gbs"] * 1e9) * 1e3)
        assert point["fraction_of_roofline"] == pytest.approx(point["roofline_ms"] / point["ms_per_step"])


def test_sweep_skips_what_the_given_engine_limits_leave_out(llama):
    result = sweep(llama, [1, 2], [16, 64], steps=1, device="cpu", max_num_seqs=1, max_model_len=32)
    reasons = {(p["batch"], p["context"]): p.get("skipped") for p in result["points"]}
    assert reasons == {(1, 16): None, (2, 16): "batch 2 is more than max_num_seqs=1",
                       (1, 64): "context 64 is more than max_model_len=32",
                       (2, 64): "batch 2 is more than max_num_seqs=1"}


def test_plot_draws_a_measured_and_a_roofline_line_per_context(swept, tmp_path):
    result, output = swept
    png = tmp_path / "sweep.png"
    figure = plot_file(str(output), str(png))
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    lines = figure.axes[0].get_lines()
    assert len(lines) == 4  # contexts 16 and 64, each measured and roofline
    by_context = {16: [(1, 16), (2, 16)], 64: [(1, 64)]}
    points = {(p["batch"], p["context"]): p for p in result["points"]}
    for (measured, roofline), context in zip(zip(lines[::2], lines[1::2]), (16, 64)):
        keys = by_context[context]
        assert list(measured.get_xdata()) == [batch for batch, _ in keys] == list(roofline.get_xdata())
        assert list(measured.get_ydata()) == [points[key]["ms_per_step"] for key in keys]
        assert list(roofline.get_ydata()) == [points[key]["roofline_ms"] for key in keys]
        assert measured.get_linestyle() == "-" and roofline.get_linestyle() == "--"
        assert measured.get_color() == roofline.get_color()
    assert lines[0].get_color() != lines[2].get_color()
    assert figure.axes[0].get_xscale() == "log" and figure.axes[0].get_yscale() == "log"
    title = figure.axes[0].get_title()
    assert Path(result["model"]).name in title and result["device"] in title and \
        f"{result['copy_gbs']:.0f} GB/s" in title


def test_cli_sweeps_and_plots(llama, tmp_path, capsys):
    output, png = tmp_path / "s.json", tmp_path / "s.png"
    cli.main(["bench", "sweep", "--model", llama, "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1,2",
              "--context-lens", "16", "--steps", "1", "--output", str(output), "--plot", str(png)])
    result = json.loads(output.read_text())
    assert [(p["batch"], p["context"], "ms_per_step" in p) for p in result["points"]] == [(1, 16, True),
                                                                                           (2, 16, True)]
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    cli.main(["bench", "plot", str(output)])  # the PNG beside the JSON
    assert (tmp_path / "s.png").stat().st_size > 0
    again = tmp_path / "again.png"
    cli.main(["bench", "plot", str(output), "--output", str(again)])
    assert again.read_bytes()[:8] == PNG_SIGNATURE
    out = capsys.readouterr().out
    assert "batch    2, context     16:" in out and f"wrote {again}" in out


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "1,x"], "argument --batch-sizes: '1,x' is not a comma-separated list of positive integers"),
    (["--context-lens", "0,16"], "argument --context-lens: '0,16' is not a comma-separated list of positive"),
    (["--steps", "0"], "steps must be a positive int (the decode steps timed per point), got 0"),
    (["extra.json"], "only bench plot takes a file (SWEEP_JSON); got 'extra.json' for bench sweep"),
])
def test_bad_sweep_options_are_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "sweep", *argv, "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_sweep_rejects_sizes_it_cannot_use():
    with pytest.raises(ValueError, match=r"batch_sizes must be positive integers; got -1 in \[1, -1\]"):
        sweep(None, [1, -1], device="cpu")
    with pytest.raises(ValueError, match="context_lens is empty; give at least one size"):
        sweep(None, [1], [], device="cpu")


def test_plot_needs_a_sweep_file(tmp_path, capsys):
    not_json, skipped = tmp_path / "x.json", tmp_path / "skipped.json"
    not_json.write_text("batch 1")
    skipped.write_text(json.dumps({"points": [{"batch": 1, "context": 16, "skipped": "too big"}]}))
    for argv, message in ([[], "bench plot needs the JSON that bench sweep wrote: nanograph bench plot sweep.json"],
                          [[str(not_json)], f"{not_json} is not JSON"],
                          [[str(skipped)], "the sweep has no measured points (every one was skipped)"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["bench", "plot", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_plotting_without_matplotlib_says_how_to_get_it(swept, tmp_path, monkeypatch, capsys):
    result, output = swept
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(ImportError, match=r"needs matplotlib: pip install matplotlib \(or pip install "
                                          r"'nanograph\[bench\]'\)"):
        plot_sweep(result, str(tmp_path / "p.png"))
    # The sweep checks before it loads anything (this model folder does not exist).
    with pytest.raises(SystemExit, match="nanograph: error: plotting a sweep needs matplotlib: pip install matplotlib"):
        cli.main(["bench", "sweep", "--model", str(tmp_path / "absent"), "--plot", str(tmp_path / "p.png")])
    assert not (tmp_path / "p.png").exists()


@pytest.mark.gpu
def test_sweep_on_the_core_against_the_roofline(tmp_path):
    """Qwen3-0.6B's shape, random bf16 weights: the decode graphs of batch 1 and 4 at 128 and 2,048 tokens, each
    slower than its roofline at the copy bandwidth but within a few times of it (a step moves at least the
    weights); 4 sequences of 4,096 tokens do not fit 512 blocks."""
    folder = make_random_model(str(tmp_path / "qwen3"), "qwen3-0.6b")
    result = sweep(folder, [1, 4], [128, 2048, 4096], steps=20, device="cuda", num_kv_blocks=512, block_size=BLOCK)
    assert result["runner"] == "CudaRunner" and result["dtype"] == "bfloat16"
    points = {(p["batch"], p["context"]): p for p in result["points"]}
    assert points[4, 4096]["skipped"] == "needs 1024 KV blocks of 16 tokens; the KV cache holds 512"
    for (batch, context), point in points.items():
        if (batch, context) == (4, 4096):
            continue
        assert point["roofline_bytes"] == config_step_bytes(folder, batch, context, dtype_bytes=2)
        assert 0.05 < point["fraction_of_roofline"] < 1.05
