"""The host side of the kernel path (CPU): the blob layout of ops.sample_packed, placed from the declaration the core
exports (checked against the core's where it is built); the parameters a KernelPlan packs into it, read back at the
layout's offsets as the binding reads them and checked row by row against the parameters and token histories that
produced them; the logprobs read back from the results; and the path's calls through a stand-in for the core, which
reuse their host buffers without losing a result not read yet."""
import random

import numpy as np
import pytest
import torch

from nanograph import SamplingParams, core_available
from nanograph._core import core
from nanograph.engine.sequence import Sequence
from nanograph.sampling.kernel_path import KernelPath, PackedSample
from nanograph.sampling.kernel_plan import SEEN_WIDTH_STEP, KernelPlan
from nanograph.sampling.outputs import CopiedSample, LogprobRows, TokenLogprobs
from nanograph.sampling.packed_layout import PackedFormat
from nanograph.sampling.seen import SeenTokens
from nanograph.sampling.staging import StagingSlot

VOCAB = 1000
EOS = 7


def seq(params: SamplingParams, prompt: list[int], output: list[int] = ()) -> Sequence:
    s = Sequence("0", None, list(prompt) + list(output), params)
    s.num_prompt_tokens = len(prompt)
    if params.seed is not None:
        s.generator = random.Random(params.seed)
    return s


ROWS = [  # (params, prompt, output)
    (SamplingParams(temperature=0), [1, 2], [3]),
    (SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.2), [5, 6], [9, 9, 4]),
    (SamplingParams(temperature=0.9, top_k=20, min_tokens=4, stop_token_ids=[11, 12]), [3], [8]),
    (SamplingParams(temperature=0.8, top_p=0.9, seed=42, logprobs=3), [4, 4], []),
    (SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=2, logprobs=0), [2, 3, 2], [3]),
    (SamplingParams(temperature=1.0, min_p=0.1, min_tokens=1), [6], [1]),  # min_tokens reached: no mask
]


# The binding's reading of the layout tuple (pyext/bind_sampling.cpp): after the six counts, each field's offset in
# this order, its dtype and its shape from the counts.
COUNTS = ("rows", "logprob_columns", "num_overrides", "seen_width", "masked_width", "bias_width")
PARAM_FIELDS = [("temperatures", np.float32, ("rows",)), ("top_ks", np.int32, ("rows",)),
                ("top_ps", np.float32, ("rows",)), ("min_ps", np.float32, ("rows",)), ("keys", np.int64, ("rows",)),
                ("num_logprobs", np.int32, ("rows",)), ("override_rows", np.int32, ("rows",)),
                ("override_source", np.int32, ("num_overrides",)),
                ("seen_tokens", np.int32, ("num_overrides", "seen_width")),
                ("output_counts", np.int32, ("num_overrides", "seen_width")),
                ("presence", np.float32, ("num_overrides",)), ("frequency", np.float32, ("num_overrides",)),
                ("repetition", np.float32, ("num_overrides",)),
                ("masked_tokens", np.int32, ("num_overrides", "masked_width")),
                ("biased_tokens", np.int32, ("num_overrides", "bias_width")),
                ("biases", np.float32, ("num_overrides", "bias_width")), ("mask_others", np.int32, ("num_overrides",))]
RESULT_FIELDS = [("token_ids", np.int64, ("rows",)), ("logprobs", np.float32, ("rows", "logprob_columns")),
                 ("logprob_ids", np.int64, ("rows", "logprob_columns"))]
ALIGNMENT = 16
MAX_TOP_LOGPROBS = 32  # the kernel's (kMaxTopLogprobs)
# That reading as the core declares it (sample_packed_layout()).
DECLARATION = {"alignment": ALIGNMENT, "counts": list(COUNTS),
               "fields": [(blob, name, np.dtype(dtype).name, list(shape))
                          for blob, fields in (("params", PARAM_FIELDS), ("results", RESULT_FIELDS))
                          for name, dtype, shape in fields]}
FORMAT = PackedFormat(DECLARATION, MAX_TOP_LOGPROBS)


@pytest.mark.skipif(not core_available(), reason="the C++/CUDA core is not built")
def test_the_core_declares_the_layout_these_tests_read():
    declared = core.sample_packed_layout()
    assert declared["alignment"] == ALIGNMENT and list(declared["counts"]) == list(COUNTS)
    assert [(blob, name, dtype, list(shape)) for blob, name, dtype, shape in declared["fields"]] == \
        DECLARATION["fields"]
    assert core.MAX_TOP_LOGPROBS == MAX_TOP_LOGPROBS


def fields_of(layout: tuple, fields: list, first: int) -> dict[str, tuple[int, type, tuple[int, ...]]]:
    """(offset, dtype, shape) of each field, from the layout tuple, the fields' offsets starting at first."""
    counts = dict(zip(COUNTS, layout))
    return {name: (layout[first + i], dtype, tuple(counts[c] for c in shape))
            for i, (name, dtype, shape) in enumerate(fields)}


def read(blob: np.ndarray, field: tuple[int, type, tuple[int, ...]]) -> np.ndarray:
    offset, dtype, shape = field
    return blob[offset:offset + int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


def kernel_plan(seqs: list[Sequence], seen: SeenTokens | None = None, batch=None) -> KernelPlan:
    """The plan of a path whose key stream is seeded with 0."""
    return KernelPlan(seqs, VOCAB, [EOS], seen or SeenTokens(), np.random.default_rng(0), FORMAT, batch)


def plan_for(rows=ROWS) -> tuple[KernelPlan, list[Sequence]]:
    seqs = [seq(*row) for row in rows]
    return kernel_plan(seqs), seqs


def packed(plan: KernelPlan) -> dict[str, np.ndarray]:
    """The parameter fields as the binding reads them from a blob the plan packed (over stale bytes)."""
    layout = plan.layout
    blob = np.full(layout.params_nbytes + 64, 0xA5, np.uint8)
    layout.pack(plan.arrays, blob)
    return {name: read(blob, field)
            for name, field in fields_of(layout.layout, PARAM_FIELDS, len(COUNTS)).items()}


def test_the_layout_places_every_field_aligned_after_the_one_before():
    layout = FORMAT.layout(rows=5, logprob_columns=4, num_overrides=2, seen_width=3, masked_width=1, bias_width=2)
    # temperatures 20 bytes, top_ks, top_ps, min_ps, keys 40, num_logprobs, override_rows, override_source 8,
    # seen_tokens 24, output_counts 24, presence 8, frequency 8, repetition 8, masked_tokens 8, biased_tokens 16,
    # biases 16, mask_others 8.
    assert layout.layout == (5, 4, 2, 3, 1, 2, 0, 32, 64, 96, 128, 176, 208, 240, 256, 288, 320, 336, 352, 368,
                             384, 400, 416, 0, 48, 128)
    assert layout.params_nbytes == 424
    assert layout.results_nbytes == 48 + 80 + 160  # token ids, logprobs float32, their ids int64
    for fields, first in [(PARAM_FIELDS, len(COUNTS)), (RESULT_FIELDS, len(COUNTS) + len(PARAM_FIELDS))]:
        assert len(layout.layout) == len(COUNTS) + len(PARAM_FIELDS) + len(RESULT_FIELDS)
        end = 0
        for offset, dtype, shape in fields_of(layout.layout, fields, first).values():
            assert offset % ALIGNMENT == 0 and end <= offset < end + ALIGNMENT
            end = offset + int(np.prod(shape)) * np.dtype(dtype).itemsize


def test_a_layout_without_overrides_or_logprobs_has_empty_fields_for_them():
    layout = FORMAT.layout(rows=3, logprob_columns=0, num_overrides=0, seen_width=0, masked_width=0, bias_width=0)
    params = fields_of(layout.layout, PARAM_FIELDS, len(COUNTS))
    assert params["override_source"][2] == (0,)
    assert params["seen_tokens"][2] == params["masked_tokens"][2] == (0, 0)
    assert params["override_rows"][0] == 112 and layout.params_nbytes == 128  # the empty fields at the next offset
    assert layout.results_nbytes == 32  # token ids, then the empty logprobs at the next offset


def test_each_row_gets_its_own_parameters():
    plan, _ = plan_for()
    a = packed(plan)
    # rows, 1 + most top logprobs, overrides, widths (seen tokens: 2, rounded up)
    assert plan.layout.layout[:5] == (len(ROWS), 1 + 3, 3, SEEN_WIDTH_STEP, 3)
    assert a["temperatures"].tolist() == np.float32([0, 0.7, 0.9, 0.8, 0, 1.0]).tolist()
    assert a["top_ks"].tolist() == [0, 0, 20, 0, 0, 0]  # 0: none (and none for greedy rows)
    assert a["top_ps"].tolist() == np.float32([1, 1, 1, 0.9, 1, 1]).tolist()
    assert a["min_ps"].tolist() == np.float32([0, 0, 0, 0, 0, 0.1]).tolist()
    assert a["num_logprobs"].tolist() == [-1, -1, -1, 3, 0, -1]


def test_biased_and_bad_word_rows_read_overrides_with_their_biases_and_masks():
    """logit_bias: the row's ids and biases; allowed_token_ids: every allowed id, with its logit_bias or 0 (a bias
    outside them is dropped), and every other token masked; bad_words: the last token of each word whose other
    tokens end the output, beside min_tokens' masks."""
    rows = [
        (SamplingParams(temperature=0), [1], [2]),
        (SamplingParams(temperature=0.5, logit_bias={5: 2.5, 900: -3.0}), [1], []),
        (SamplingParams(temperature=0, allowed_token_ids=[10, 11, 12], logit_bias={11: 1.0, 13: 9.0}), [1], []),
        (SamplingParams(temperature=0.7, min_tokens=3), [1], [4]),
    ]
    seqs = [seq(*row) for row in rows]
    seqs[3].bad_words_token_ids = [[4, 20], [21], [5, 22]]
    plan = kernel_plan(seqs)
    a = packed(plan)
    assert a["override_source"].tolist() == [1, 2, 3]
    assert a["override_rows"].tolist() == [-1, 0, 1, 2]
    assert plan.layout.counts["bias_width"] == 3
    biases = [{t: b for t, b in zip(tokens.tolist(), values.tolist()) if t >= 0}
              for tokens, values in zip(a["biased_tokens"], a["biases"])]
    assert biases == [{5: 2.5, 900: -3.0}, {10: 0.0, 11: 1.0, 12: 0.0}, {}]
    assert a["mask_others"].tolist() == [0, 1, 0]
    assert [sorted(t for t in row.tolist() if t >= 0) for row in a["masked_tokens"]] == [[], [], [EOS, 20, 21]]


def test_keys_come_from_the_row_stream_when_seeded_and_greedy_rows_draw_none():
    plan, _ = plan_for()
    keys = packed(plan)["keys"].view(np.uint64).tolist()
    assert keys[0] == keys[4] == 0  # greedy
    assert keys[3] == random.Random(42).getrandbits(64)  # the request's own stream
    assert len({keys[1], keys[2], keys[5], keys[3]}) == 4
    again, _ = plan_for()  # the sampler's stream is seeded too
    assert packed(again)["keys"].tolist() == packed(plan)["keys"].tolist()


def test_penalised_and_masked_rows_read_overrides_with_their_seen_and_masked_tokens():
    plan, _ = plan_for()
    a = packed(plan)
    # Row 1: penalties; row 2: min_tokens not reached; row 4: both; row 5 reached its min_tokens.
    assert a["override_source"].tolist() == [1, 2, 4]
    assert a["override_rows"].tolist() == [-1, 0, 1, -1, 2, -1]
    seen = {i: sorted(zip(tokens.tolist(), counts.tolist()))
            for i, tokens, counts in zip(range(3), a["seen_tokens"], a["output_counts"])}
    assert [(t, c) for t, c in seen[0] if t >= 0] == [(4, 1), (9, 2)]  # output only: no repetition penalty
    assert [t for t, _ in seen[1]] == [-1] * a["seen_tokens"].shape[1]  # masked, not penalised
    assert [(t, c) for t, c in seen[2] if t >= 0] == [(2, 0), (3, 1)]  # prompt too: repetition penalty
    penalties = np.stack([a["presence"], a["frequency"], a["repetition"]])
    assert penalties[:, 0].tolist() == np.float32([0.5, 0.2, 1]).tolist()
    assert penalties[:, 1].tolist() == [0, 0, 1]  # no penalty on a masked-only row
    assert penalties[:, 2].tolist() == np.float32([0, 0, 1.3]).tolist()
    masked = [sorted(t for t in row.tolist() if t >= 0) for row in a["masked_tokens"]]
    assert masked == [[], [EOS, 11, 12], [EOS]]


def test_a_batch_without_penalties_or_masks_has_no_overrides():
    plan, _ = plan_for([(SamplingParams(temperature=0), [1], []), (SamplingParams(top_k=3), [2], [5])])
    assert len(plan.override_source) == 0
    assert plan.layout.layout[:5] == (2, 0, 0, 0, 0)
    assert packed(plan)["override_rows"].tolist() == [-1, -1]


def test_seen_tokens_grow_with_the_sequence_between_calls():
    seen = SeenTokens()
    s = seq(SamplingParams(frequency_penalty=1.0), [1, 2], [5])
    first = kernel_plan([s], seen)
    pad = [-1] * (SEEN_WIDTH_STEP - 2)
    assert packed(first)["seen_tokens"].tolist() == [[5, -1] + pad]
    s.token_ids += [5, 6]
    second = packed(kernel_plan([s], seen))
    assert second["seen_tokens"].tolist() == [[5, 6] + pad]
    assert second["output_counts"].tolist() == [[2, 1] + [0] * len(pad)]
    s.token_ids += list(range(100, 100 + SEEN_WIDTH_STEP))  # one more distinct token than the width holds
    third = packed(kernel_plan([s], seen))
    assert third["seen_tokens"].shape == (1, 2 * SEEN_WIDTH_STEP)
    assert third["seen_tokens"][0, :SEEN_WIDTH_STEP + 2].tolist() == [5, 6] + list(range(100, 100 + SEEN_WIDTH_STEP))


def test_a_plan_reuses_the_last_batch_rows_only_for_the_same_sequences_and_parameters():
    """The parameters' per-row arrays are kept from call to call while the batch is the same; another order, another
    sequence, or new parameters on one of them make new ones, and every plan packs what a fresh one packs."""
    seqs = [seq(*row) for row in ROWS]
    first = kernel_plan(seqs)
    same = kernel_plan(list(seqs), batch=first.batch)
    assert same.batch is first.batch

    def assert_like_fresh(plan, seqs):
        """Every field as a fresh plan's; keys of the unseeded rows only (a seeded row's stream has moved on)."""
        fresh = packed(kernel_plan(seqs))
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        for name, values in packed(plan).items():
            if name == "keys":
                values, fresh[name] = values[unseeded], fresh[name][unseeded]
            assert values.tolist() == fresh[name].tolist(), name

    assert_like_fresh(same, seqs)
    reordered = seqs[::-1]
    plan = kernel_plan(reordered, batch=first.batch)
    assert plan.batch is not first.batch
    assert_like_fresh(plan, reordered)
    other = seqs[:-1] + [seq(SamplingParams(temperature=0.5, top_k=3), [1], [2])]
    plan = kernel_plan(other, batch=first.batch)
    assert plan.batch is not first.batch
    assert_like_fresh(plan, other)
    seqs[2].params = SamplingParams(temperature=0.3, top_p=0.5)
    plan = kernel_plan(seqs, batch=first.batch)
    assert plan.batch is not first.batch and packed(plan)["top_ps"][2] == np.float32(0.5)
    assert_like_fresh(plan, seqs)


def test_a_batch_of_plain_greedy_rows_needs_no_kernel_fields():
    rows = [(SamplingParams(temperature=0), [1, 2], [3]), (SamplingParams(temperature=0), [4], [])]
    plan, _ = plan_for(rows)
    assert plan.plain_greedy and plan.layout is None
    for params in (SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0, presence_penalty=0.1),
                   SamplingParams(temperature=0, min_tokens=3), SamplingParams(temperature=0.5)):
        plan, _ = plan_for(rows + [(params, [1], [])])
        assert not plan.plain_greedy and plan.layout is not None


def test_more_top_logprobs_than_the_kernel_gives_leave_the_kernel_none():
    plan, _ = plan_for([(SamplingParams(logprobs=40), [1], []), (SamplingParams(logprobs=2), [2], [])])
    assert not plan.kernel_logprobs
    assert plan.layout.layout[1] == 0 and plan.layout.results_nbytes == 2 * 8


LOGPROB_VALUES = [[-1.5, -0.5, -1.0], [-0.25, -0.25, -3.0]]  # the sampled token's, then the top ones
LOGPROB_IDS = [[2, 3, 4], [0, 2, 9]]  # the sampled token's rank - 1, then the top ones' ids


def test_pending_logprobs_are_read_from_the_rows_that_asked():
    """The torch path's layout: a row per row that asked. Only those rows get TokenLogprobs, with the sampled token
    first and ranks from 1."""
    pending = CopiedSample(torch.tensor([5, 8, 2]), LogprobRows(rows=[1, 2], num_top=[2, 1]),
                           torch.tensor(LOGPROB_VALUES), torch.tensor(LOGPROB_IDS))
    out = pending.result()
    assert out.token_ids == [5, 8, 2]
    assert out.logprobs[0] is None
    assert out.logprobs[1] == TokenLogprobs([8, 3, 4], [-1.5, -0.5, -1.0], [3, 1, 2])
    assert out.logprobs[2] == TokenLogprobs([2, 2], [-0.25, -0.25], [1, 1])


def test_packed_results_are_read_back_from_one_blob():
    """The kernels' layout: a row per batch row in one results blob, read back through the results buffer of a
    staging slot; token_ids stays a view of the blob (the engine feeds the next step from it)."""
    layout = FORMAT.layout(rows=3, logprob_columns=3, num_overrides=0, seen_width=0, masked_width=0, bias_width=0)
    blob = np.zeros(layout.results_nbytes, np.uint8)
    results = fields_of(layout.layout, RESULT_FIELDS, len(COUNTS) + len(PARAM_FIELDS))
    read(blob, results["token_ids"])[:] = [5, 8, 2]
    read(blob, results["logprobs"])[1:] = LOGPROB_VALUES
    read(blob, results["logprob_ids"])[1:] = LOGPROB_IDS
    device_blob = torch.from_numpy(blob)
    slot = StagingSlot(pin=False)
    slot.reclaim(layout)
    pending = PackedSample(device_blob, layout, slot.hold(device_blob), LogprobRows(rows=[1, 2], num_top=[2, 1]))
    assert pending.token_ids.dtype == torch.int64 and pending.token_ids.data_ptr() == device_blob.data_ptr()
    out = pending.result()
    assert out.token_ids == [5, 8, 2]
    assert out.logprobs[0] is None
    assert out.logprobs[1] == TokenLogprobs([8, 3, 4], [-1.5, -0.5, -1.0], [3, 1, 2])
    assert out.logprobs[2] == TokenLogprobs([2, 2], [-0.25, -0.25], [1, 1])


def test_results_still_held_when_their_slot_is_reused_keep_their_own_bytes():
    """The slot's next call overwrites its host buffer: reclaiming the slot first gives the results not taken yet a
    copy of their own, so that they read as their call's whenever they are taken; results are taken once."""
    layout = FORMAT.layout(rows=4, logprob_columns=0, num_overrides=0, seen_width=0, masked_width=0, bias_width=0)
    slot = StagingSlot(pin=False)
    slot.reclaim(layout)
    early = slot.hold(torch.full((layout.results_nbytes,), 1, dtype=torch.uint8))
    assert early.take().tolist() == [1] * layout.results_nbytes
    slot.reclaim(layout)
    late = slot.hold(torch.full((layout.results_nbytes,), 2, dtype=torch.uint8))
    slot.reclaim(layout)
    slot.hold(torch.full((layout.results_nbytes,), 3, dtype=torch.uint8))
    assert late.take().tolist() == [2] * layout.results_nbytes
    with pytest.raises(RuntimeError, match="taken"):
        late.take()


class FakeCore:
    """The core on the host: its declaration of the blobs (DECLARATION), and ops.sample_packed, where each row's
    token is its top_k + 100 * (its override + 1) (read from the parameters at the layout's offsets), its logprobs
    its temperature then -row; every call's parameters are kept."""
    MAX_TOP_LOGPROBS = MAX_TOP_LOGPROBS

    def __init__(self):
        self.calls = []

    @staticmethod
    def sample_packed_layout() -> dict:
        return DECLARATION

    def sample_packed(self, logits, params, layout, results, overrides):
        blob, out = params.numpy().copy(), results.numpy()
        fields = fields_of(layout, PARAM_FIELDS, len(COUNTS))
        self.calls.append({name: read(blob, field) for name, field in fields.items()})
        rows, columns, num_overrides = layout[:3]
        assert logits.shape[0] == rows
        assert (overrides is None) == (num_overrides == 0)
        assert overrides is None or overrides.shape == (num_overrides, logits.shape[1])
        fields = fields_of(layout, RESULT_FIELDS, len(COUNTS) + len(PARAM_FIELDS))
        call = self.calls[-1]
        read(out, fields["token_ids"])[:] = call["top_ks"] + 100 * (call["override_rows"] + 1)
        read(out, fields["logprobs"])[:] = call["temperatures"][:, None]
        read(out, fields["logprob_ids"])[:] = -np.arange(rows)[:, None]


@pytest.fixture
def kernel_path() -> tuple[KernelPath, FakeCore]:
    """The kernel path on the host, with FakeCore for the core."""
    fake_core = FakeCore()
    return KernelPath(torch.device("cpu"), [EOS], 0, fake_core), fake_core


def test_the_kernel_path_sends_the_plan_and_reads_the_results(kernel_path):
    path, fake_core = kernel_path
    seqs = [seq(*row) for row in ROWS]
    out = path.sample(torch.zeros(len(ROWS), VOCAB), seqs).result()
    sent = fake_core.calls[-1]
    assert sent["top_ks"].tolist() == [0, 0, 20, 0, 0, 0]
    assert sent["override_source"].tolist() == [1, 2, 4]
    assert out.token_ids == [0, 100, 220, 0, 300, 0]  # top_k + 100 * (override + 1)
    assert out.logprobs[3] == TokenLogprobs([0, -3, -3, -3], np.float32([0.8] * 4).tolist(), [-2, 1, 2, 3])
    assert out.logprobs[4] == TokenLogprobs([300], [0.0], [-3])
    assert [i for i, entry in enumerate(out.logprobs) if entry is not None] == [3, 4]


def test_a_result_not_read_survives_the_reuse_of_its_host_buffers(kernel_path):
    """Two staging slots: the third call reuses the first's buffers, the fourth the second's, while their results
    have not been read."""
    path, _ = kernel_path
    batches = [[seq(SamplingParams(top_k=k + i), [1])] * 3 for i, k in enumerate((5, 7, 9, 11))]
    pending = [path.sample(torch.zeros(3, VOCAB), batch) for batch in batches]
    assert [p.result().token_ids for p in pending] == [[5] * 3, [8] * 3, [11] * 3, [14] * 3]


def test_more_top_logprobs_than_the_kernel_gives_come_from_torch(kernel_path):
    path, fake_core = kernel_path
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    out = path.sample(logits, [seq(SamplingParams(temperature=0, logprobs=40), [1]),
                               seq(SamplingParams(top_k=3), [2])]).result()
    assert fake_core.calls[-1]["num_logprobs"].tolist() == [40, -1]  # sent, but the kernel is asked for none
    assert out.token_ids == [0, 3]
    raw = logits[0].log_softmax(-1)
    entry = out.logprobs[0]
    assert entry.token_ids[0] == 0 and entry.ranks[0] == int((raw > raw[0]).sum()) + 1
    assert entry.token_ids[1:] == raw.topk(40).indices.tolist()
    assert out.logprobs[1] is None
