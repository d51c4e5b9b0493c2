"""logit_bias, allowed_token_ids, bad_words and the grammar bitmask on the GPU's kernel path, against the torch path
and float32 references on the same random logits; and a mixed batch of constrained and unconstrained requests through
the CUDA runner."""
import gc
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from nanograph import LLM, SamplingParams, StructuredOutputsParams, ops
from nanograph._core import require_core
from nanograph.sampling import Sampler
from nanograph.sampling.kernel_plan import KernelPlan
from nanograph.sampling.packed_layout import PackedFormat
from nanograph.sampling.seen import SeenTokens
from nanograph.sampling.token_bitmask import TokenBitmask
from nanograph.sampling.torch_path import TorchPath

from ..hf_models import make_random_model
from .test_api_sampler import EOS, reference_penalties, seq
from .test_sampler_constraints import FixedGrammar, biased, packed_bits, random_biases, random_bitmask

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]
VOCAB = 151936
PROMPT, OUTPUT = [5, 17, 40, 1000], [17, 99, 4]
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.8)


def torch_sampler() -> Sampler:
    """A sampler on the GPU that takes the torch path, bitmask included."""
    sampler = Sampler(DEVICE, [EOS], 0)
    sampler.path, sampler.bitmask = TorchPath(DEVICE, [EOS], 0), TokenBitmask(DEVICE)
    return sampler


def allowed_bias(allowed: list[int], biases: dict[int, float]) -> dict[int, float]:
    """A bias on an allowed token, and some on (most likely) others, which allowed_token_ids drops."""
    return {allowed[0]: 3.0, **dict(list(biases.items())[:8])}


def constrained_batch(rows: int, seed: int, temperature: float = 0.0):
    """Sequences cycling through logit_bias, allowed_token_ids (with a bias), bad_words and none, each alone and with
    penalties, and the float32 reference of each
    row's processed logits as a function of its raw row: bias, then penalties, then -inf at masked tokens."""
    biases = random_biases(rows, seed, VOCAB, per_row=64)
    generator = torch.Generator().manual_seed(seed + 1)
    allowed = [torch.randperm(VOCAB, generator=generator)[:512].tolist() for _ in range(rows)]
    seqs, references = [], []
    for r in range(rows):
        kind, penalised = r % 4, r % 8 >= 4
        params = dict(temperature=temperature, **(PENALTIES if penalised else {}))
        if kind == 0:
            params["logit_bias"] = biases[r]
        elif kind == 1:
            params.update(allowed_token_ids=allowed[r], logit_bias=allowed_bias(allowed[r], biases[r]))
        s = seq(SamplingParams(**params), PROMPT, OUTPUT)
        if kind == 2:
            s.bad_words_token_ids = [[OUTPUT[-1], 7], [8], [3, 9]]  # 7 and 8 masked, 9 not
        seqs.append(s)

        def reference(row: torch.Tensor, kind=kind, penalised=penalised, r=r) -> torch.Tensor:
            row = row.float()
            if kind == 0:
                row = biased(row, biases[r])
            elif kind == 1:
                kept = torch.full_like(row, float("-inf"))
                kept[allowed[r]] = row[allowed[r]]
                bias = allowed_bias(allowed[r], biases[r])
                row = biased(kept, {t: b for t, b in bias.items() if t in set(allowed[r])})
            if penalised:
                row = reference_penalties(row, PROMPT, OUTPUT, 0.5, 0.3, 1.8)
            if kind == 2:
                row[[7, 8]] = float("-inf")
            return row
        references.append(reference)
    return seqs, references


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_paths_overrides_are_the_reference_processed_rows(dtype):
    """The packed call's override rows (biased, penalised, masked) against the float32 reference of each row."""
    rows = 32
    logits = (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    seqs, references = constrained_batch(rows, seed=1)
    plan = KernelPlan(seqs, VOCAB, [EOS], SeenTokens(), np.random.default_rng(0), PackedFormat.of(require_core()))
    layout = plan.layout
    blob = np.zeros(layout.params_nbytes, np.uint8)
    layout.pack(plan.arrays, blob)
    overrides = torch.empty(layout.counts["num_overrides"], VOCAB, device=DEVICE)
    results = torch.empty(layout.results_nbytes, dtype=torch.uint8, device=DEVICE)
    ops.sample_packed(logits.to(DEVICE), torch.from_numpy(blob).to(DEVICE), layout.layout, results, overrides)
    plain = [r for r in range(rows) if r % 8 == 3]  # neither a constraint nor a penalty
    assert plan.override_source.tolist() == [r for r in range(rows) if r not in plain]
    for r in plan.override_source.tolist():
        torch.testing.assert_close(overrides[int(plan.arrays["override_rows"][r])].cpu(), references[r](logits[r]),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_constrained_rows_agree_with_the_torch_path(dtype):
    rows = 64
    logits = (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(2)) * 4).to(dtype).to(DEVICE)
    seqs, references = constrained_batch(rows, seed=3)
    allowed = random_bitmask(rows, seed=4, vocab=VOCAB, allowed_share=0.01)
    words = packed_bits(allowed)
    for r in range(0, rows, 3):
        if r % 4 != 1:  # not with allowed_token_ids, which may leave none of the grammar's tokens
            seqs[r].grammar = FixedGrammar(words[r])
    kernel = Sampler(DEVICE, [EOS], 0).sample(logits.clone(), seqs).result().token_ids
    reference = torch_sampler().sample(logits.clone(), seqs).result().token_ids
    for r in range(rows):
        row = references[r](logits[r].cpu())
        if seqs[r].grammar is not None:
            row = row.masked_fill(~allowed[r], float("-inf"))
        # Both take a maximum of the processed row (ties, and float32 rounding of penalties, may pick another).
        assert float(row[kernel[r]]) == pytest.approx(float(row.max()), rel=1e-6)
        assert float(row[reference[r]]) == pytest.approx(float(row.max()), rel=1e-6)
    assert sum(k == t for k, t in zip(kernel, reference)) >= rows - 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_constrained_rows_draw_only_what_their_constraints_allow(dtype):
    rows = 256
    logits = (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    logits[:, [7, 8]] = 40  # the bad words' tokens would win
    seqs, references = constrained_batch(rows, seed=6, temperature=1.0)
    allowed = random_bitmask(rows, seed=7, vocab=VOCAB, allowed_share=0.01)
    words = packed_bits(allowed)
    for r in range(2, rows, 3):
        if r % 4 != 1:
            seqs[r].grammar = FixedGrammar(words[r])
    token_ids = Sampler(DEVICE, [EOS], 0).sample(logits.to(DEVICE), seqs).result().token_ids
    for r, token_id in enumerate(token_ids):
        assert references[r](logits[r])[token_id].isfinite()
        assert seqs[r].grammar is None or allowed[r, token_id]


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=5),
                                    dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, min_p=0.1),
                                    dict(temperature=1.0, top_k=50, top_p=0.8, min_p=0.01)],
                         ids=["greedy", "full", "top_k", "top_p", "min_p", "all"])
def test_a_row_whose_every_token_is_masked_leaves_the_others_alone(path, params):
    """A grammar that allows nothing (with bad_words or allowed_token_ids, a real one can): that row gets the id past
    the vocabulary, on which the engine fails its request, on either path and however it is truncated; the other
    rows, sampled with the same parameters, their own seeds and logprobs, get exactly what they get when the row is
    not masked."""
    rows, masked = 6, 2
    logits = (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(9)) * 4).to(DEVICE)
    nothing = packed_bits(torch.zeros(1, VOCAB, dtype=torch.bool))[0]

    def run(mask: bool):
        seqs = [seq(SamplingParams(seed=r, logprobs=2, **params), PROMPT, OUTPUT) for r in range(rows)]
        if mask:
            seqs[masked].grammar = FixedGrammar(nothing)
        sampler = Sampler(DEVICE, [EOS], 0) if path == "kernel" else torch_sampler()
        return sampler.sample(logits.clone(), seqs).result()

    plain, with_mask = run(False), run(True)
    others = [r for r in range(rows) if r != masked]
    assert [with_mask.token_ids[r] for r in others] == [plain.token_ids[r] for r in others]
    assert [with_mask.logprobs[r] for r in others] == [plain.logprobs[r] for r in others]
    assert with_mask.token_ids[masked] == VOCAB


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [VOCAB, 1000 + 7])
def test_the_bitmask_kernel_masks_exactly_the_reference_tokens(dtype, vocab):
    """ops.apply_token_bitmask on a row slice of a wider buffer, poisoned (NaN) past the vocabulary and random in
    the bitmask's bits past it: the listed rows are -inf where their bit is 0 and unchanged elsewhere; other rows,
    the columns past the vocabulary and the bits past it are left alone."""
    rows, width = 40, vocab + 40
    generator = torch.Generator().manual_seed(vocab)
    buffer = (torch.randn(rows, width, generator=generator) * 4).to(dtype)
    buffer[:, vocab:] = float("nan")
    listed = torch.randperm(rows, generator=generator)[:17].sort().values
    allowed = random_bitmask(len(listed), seed=8, vocab=vocab, allowed_share=0.3)
    allowed[0] = True  # all allowed
    allowed[1] = False  # none
    words = torch.from_numpy(packed_bits(allowed))
    if vocab % 32:
        words[:, -1] |= torch.randint(0, 2**31 - 1, (len(listed),), generator=generator, dtype=torch.int32) \
            & ~((1 << (vocab % 32)) - 1)
    expected = buffer.clone()
    expected[listed, :vocab] = buffer[listed, :vocab].masked_fill(~allowed, float("-inf"))
    on_device = buffer.to(DEVICE)
    ops.apply_token_bitmask(on_device[:, :vocab], words.to(DEVICE), listed.to(torch.int32).to(DEVICE))
    assert torch.equal(on_device.cpu()[:, :vocab], expected[:, :vocab])
    assert on_device[:, vocab:].isnan().all()
    with pytest.raises(Exception, match="bitmask"):
        ops.apply_token_bitmask(on_device[:, :vocab], words[:, :-1].to(DEVICE), listed.to(torch.int32).to(DEVICE))


def test_the_bitmask_costs_little_at_batch_64():
    """Printed, not asserted: the host-to-device copy and the kernel of a 64-row bitmask at 151,936 tokens."""
    logits = torch.randn(64, VOCAB, device=DEVICE).to(torch.bfloat16)
    words = torch.from_numpy(packed_bits(random_bitmask(64, seed=9, vocab=VOCAB))).pin_memory()
    rows = torch.arange(64, dtype=torch.int32).pin_memory()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        ops.apply_token_bitmask(logits, words.to(DEVICE, non_blocking=True), rows.to(DEVICE, non_blocking=True))
    start.record()
    for _ in range(100):
        ops.apply_token_bitmask(logits, words.to(DEVICE, non_blocking=True), rows.to(DEVICE, non_blocking=True))
    end.record()
    end.synchronize()
    print(f"bitmask copy + apply, 64 x {VOCAB}: {start.elapsed_time(end) / 100 * 1e3:.1f} us per step")


@pytest.fixture(scope="module")
def folder_with_tokenizer(tmp_path_factory):
    """A random Qwen3-0.6B of SmolLM2's vocabulary, with SmolLM2's tokenizer (grammars need one)."""
    pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")
    from nanograph.default_model import default_model_path
    try:
        tokenizer_folder = Path(default_model_path())
    except Exception as exc:
        pytest.skip(f"no default model for its tokenizer: {exc}")
    folder = make_random_model(str(tmp_path_factory.mktemp("qwen3-smollm2-vocab")), "qwen3-0.6b", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (tokenizer_folder / name).is_file():
            shutil.copy(tokenizer_folder / name, folder)
    return folder


def test_a_mixed_batch_through_the_cuda_runner(folder_with_tokenizer):
    """Constrained requests (regex, choice, a JSON schema, bias, allowed ids, bad words) follow their constraints;
    unconstrained ones in the same batch get exactly the tokens they get when no row is constrained."""
    phone = r"[0-9]{3}-[0-9]{4}"  # \d would allow any script's digits, several tokens each
    free = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.8, seed=3, max_tokens=12)]
    requests = [
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=phone)),
        SamplingParams(temperature=1.0, n=2, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"])),
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})),
        SamplingParams(temperature=0.7, max_tokens=12, allowed_token_ids=list(range(100, 300)),
                       logit_bias={150: 5.0}),
        SamplingParams(temperature=0, max_tokens=12, bad_words=["the"]),
        *free]
    prompts = [[1, 2, 3, 4 + i] for i in range(len(requests))]
    llm = LLM(folder_with_tokenizer, device="cuda", max_model_len=256)
    try:
        outputs = llm.generate(prompts, requests, use_tqdm=False)
        # The first tokens, from one prefill of the same batch with and without the constraints: in bf16 a batch of
        # another shape rounds otherwise, so the free rows are compared within the same batch.
        first = llm.generate(prompts, [replace(params, max_tokens=1) for params in requests], use_tqdm=False)
        plain_first = llm.generate(prompts, [SamplingParams(temperature=params.temperature, n=params.n, seed=params.seed,
                                                            max_tokens=1) for params in requests], use_tqdm=False)
        tokenizer = llm.tokenizer
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert all(output.error is None for output in outputs)
    assert re.fullmatch(phone, outputs[0].outputs[0].text) and outputs[0].outputs[0].finish_reason == "stop"
    assert all(c.text in ("red", "green", "blue") for c in outputs[1].outputs) and len(outputs[1].outputs) == 2
    if outputs[2].outputs[0].finish_reason == "stop":  # a random model may spend its tokens on whitespace
        assert isinstance(json.loads(outputs[2].outputs[0].text)["ok"], bool)
    assert set(outputs[3].outputs[0].token_ids) <= set(range(100, 300))
    banned = {tuple(tokenizer.encode(w, add_special_tokens=False)) for w in ("the", " the")}
    tokens = outputs[4].outputs[0].token_ids
    assert not any(tuple(tokens[i:i + len(w)]) == w for w in banned for i in range(len(tokens)))
    assert [o.outputs[0].token_ids for o in first[-2:]] == [o.outputs[0].token_ids for o in plain_first[-2:]]
    assert re.fullmatch("[0-9]{1,3}", first[0].outputs[0].text) and set(first[3].outputs[0].token_ids) <= set(range(100, 300))
