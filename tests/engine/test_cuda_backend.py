"""The CUDA core's forward against HF transformers on random-weight models of real shapes (GPU)."""
import copy

import numpy as np
import pytest
import torch

from nanograph import SamplingParams
from nanograph.config import Config
from nanograph.engine.batch import ForwardBatch
from nanograph.engine.sequence import Sequence
from nanograph.model_config import ModelConfig

from ..hf_models import make_random_model

pytestmark = pytest.mark.gpu

MODELS = ["qwen3-0.6b", "llama-3.2-1b", "qwen2-0.5b", "mistral-7b-v0.3"]
OVERRIDES = {"mistral-7b-v0.3": {"num_hidden_layers": 3}}  # its real layer shapes, fewer of them
BLOCK = 16


@pytest.fixture(scope="module", params=MODELS)
def model_pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from nanograph.backends.cuda_backend import CudaRunner

    folder = make_random_model(str(tmp_path_factory.mktemp(request.param)), request.param,
                               **OVERRIDES.get(request.param, {}))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    config = Config(model=folder, dtype="bfloat16", max_model_len=512, max_num_seqs=16,
                    max_num_batched_tokens=2048, num_kv_blocks=512, block_size=BLOCK, device="cuda")
    runner = CudaRunner(config, ModelConfig.from_pretrained(folder))
    yield request.param, hf, runner
    del runner, hf
    torch.cuda.empty_cache()


class Tables:
    """Hands out KV blocks to sequences, as the block manager would."""

    def __init__(self):
        self.next_block = 0
        self.tables = {}

    def ensure(self, seq, length):
        table = self.tables.setdefault(seq, [])
        while len(table) * BLOCK < length:
            table.append(self.next_block)
            self.next_block += 1
        return table

    def batch(self, seq_ids, starts, new_tokens):
        """ForwardBatch for sequences `seq_ids`, each with new tokens appended at position starts[i]."""
        ids, pos, slots, lens = [], [], [], []
        for s, start, toks in zip(seq_ids, starts, new_tokens):
            table = self.ensure(s, start + len(toks))
            p = np.arange(start, start + len(toks))
            ids.append(np.asarray(toks)); pos.append(p)
            slots.append(np.asarray(table)[p // BLOCK] * BLOCK + p % BLOCK)
            lens.append(start + len(toks))
        width = max(len(self.tables[s]) for s in seq_ids)
        bt = np.zeros((len(seq_ids), width), np.int32)
        for row, s in zip(bt, seq_ids):
            row[:len(self.tables[s])] = self.tables[s]
        q = [len(t) for t in new_tokens]
        input_ids = np.concatenate(ids).astype(np.int32)
        return ForwardBatch(input_ids, np.full(len(input_ids), -1, np.int32), np.concatenate(pos).astype(np.int32),
                            np.concatenate(slots).astype(np.int32),
                            np.concatenate([[0], np.cumsum(q)]).astype(np.int32),
                            np.asarray(lens, np.int32), bt, all(n == 1 for n in q))


def test_teacher_forced_logprobs_match_hf(model_pair):
    name, hf, runner = model_pair
    gen = torch.Generator().manual_seed(1)
    lengths = [37, 100, 64, 5]
    seqs = [torch.randint(0, runner.model_config.vocab_size, (n + 24,), generator=gen) for n in lengths]
    with torch.no_grad():
        ref = [torch.log_softmax(hf(s[None].cuda()).logits[0].float(), -1) for s in seqs]
        # An fp32 reference says how far bf16 itself strays. A copy: a round trip through fp32 would leave hf's
        # float buffers (RoPE's inverse frequencies) in bf16, a worse reference for the tests after this one.
        hf32 = copy.deepcopy(hf).float()
        exact = [torch.log_softmax(hf32(s[None].cuda()).logits[0], -1) for s in seqs]
        del hf32

    tables = Tables()
    # Prefill the prompts in one batch, then decode the teacher tokens one step at a time.
    ours = [[] for _ in seqs]
    logits = runner.run(tables.batch(range(len(seqs)), [0] * len(seqs),
                                     [s[:n].tolist() for s, n in zip(seqs, lengths)]))
    for i in range(len(seqs)):
        ours[i].append(torch.log_softmax(logits[i].float(), -1))
    for step in range(24 - 1):
        logits = runner.run(tables.batch(range(len(seqs)), [n + step for n in lengths],
                                         [[s[n + step].item()] for s, n in zip(seqs, lengths)]))
        for i in range(len(seqs)):
            ours[i].append(torch.log_softmax(logits[i].float(), -1))
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        got = torch.stack(ours[i])
        want = ref[i][n - 1:n + 23]
        fp32 = exact[i][n - 1:n + 23]
        err = (got - want).abs()
        assert torch.isfinite(got).all()
        # Within bf16 tolerance: against fp32, our error is no larger than HF's own bf16 error
        # (with a margin), and ours and HF's logprobs agree to a few hundredths.
        ours_vs_fp32 = (got - fp32).abs().mean()
        hf_vs_fp32 = (want - fp32).abs().mean()
        assert ours_vs_fp32 < 1.5 * hf_vs_fp32 + 1e-3, (
            f"{name} seq {i}: mean |dlogprob| vs fp32 {ours_vs_fp32:.4f}, HF bf16's {hf_vs_fp32:.4f}")
        assert err.max() < 0.25, f"{name} seq {i}: max |dlogprob| {err.max():.3f}"
        assert err.mean() < 0.03, f"{name} seq {i}: mean |dlogprob| {err.mean():.4f}"
        # Random weights give near-flat distributions: top-1 may flip between near-ties, but the
        # reference's top token must stay among ours' top 5.
        top5 = got.topk(5, -1).indices
        assert (top5 == want.argmax(-1, keepdim=True)).any(-1).all(), f"{name} seq {i}: top-1 outside top-5"


def test_greedy_generation_matches_hf(model_pair):
    name, hf, runner = model_pair
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, runner.model_config.vocab_size, (n,), generator=gen).tolist()
               for n in (3, 17, 31, 64, 90, 128, 200, 250)]
    new_tokens = 32
    tables = Tables()
    base = 100  # fresh sequence ids: a fresh set of blocks
    ids = [base + i for i in range(len(prompts))]
    outs, tops = [[] for _ in prompts], [[] for _ in prompts]
    logits = runner.run(tables.batch(ids, [0] * len(prompts), prompts))
    for step in range(new_tokens):
        for i in range(len(prompts)):
            outs[i].append(int(logits[i].argmax()))
            tops[i].append(set(logits[i].topk(5).indices.tolist()))
        if step + 1 < new_tokens:
            logits = runner.run(tables.batch(ids, [len(p) + step for p in prompts], [[o[-1]] for o in outs]))
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            res = hf.generate(torch.tensor([prompt]).cuda(), max_new_tokens=new_tokens, do_sample=False,
                              output_scores=True, return_dict_in_generate=True, min_new_tokens=new_tokens)
        theirs = res.sequences[0, len(prompt):].tolist()
        for t, (a, b) in enumerate(zip(outs[i], theirs)):
            if a != b:
                hf_top = set(res.scores[t][0].float().topk(5).indices.tolist())
                assert a in hf_top and b in tops[i][t], (
                    f"{name} prompt {i}: diverged at token {t} ({a} vs {b}) outside each other's top 5")
                break


@pytest.mark.parametrize("leading", [4, 12], ids=["4-decodes", "12-decodes"])
def test_mixed_steps_match_hf(model_pair, leading):
    """Steps that mix decodes with prompt chunks, as the scheduler lays them out: `leading` one-token rows first
    (decode attention takes them: 12 of them make a large grid on 8 kv heads, run without the fused RoPE, which
    decode steps alone use), then a prompt's next chunk, a decode row after it and a new prompt (prefill attention
    takes those). Each row's logprobs against HF's teacher-forced ones at its position."""
    name, hf, runner = model_pair
    gen = torch.Generator().manual_seed(11)
    more = torch.randint(3, 150, (leading - 4,), generator=torch.Generator().manual_seed(12)).tolist()
    # Sequences before `chunked` and `trailing` decode; `chunked` is prefilled in chunks of 90 tokens; `late` comes
    # in at the second mixed step.
    chunked, late, trailing = leading, leading + 1, leading + 2
    lengths = [37, 100, 64, 5] + more + [270, 45, 20]
    seqs = [torch.randint(0, runner.model_config.vocab_size, (n + 8,), generator=gen) for n in lengths]
    with torch.no_grad():
        ref = [torch.log_softmax(hf(s[None].cuda()).logits[0].float(), -1) for s in seqs]
    decoding = list(range(leading)) + [trailing]
    tables = Tables()
    ids = [700 + i for i in range(len(seqs))]
    done = {i: lengths[i] for i in decoding}  # tokens each sequence has in the cache
    logits = runner.run(tables.batch([ids[i] for i in decoding], [0] * len(decoding),
                                     [seqs[i][:lengths[i]].tolist() for i in decoding]))
    got, want = [], []
    for i, row in zip(decoding, logits):
        got.append(torch.log_softmax(row.float(), -1)); want.append(ref[i][lengths[i] - 1])
    done[chunked] = 0
    for step in range(3):
        rows = ([(i, 1) for i in range(leading)] + [(chunked, 90), (trailing, 1)]
                + ([(late, lengths[late])] if step == 1 else []))
        starts = [done.get(i, 0) for i, _ in rows]
        batch = tables.batch([ids[i] for i, _ in rows], starts,
                             [seqs[i][start:start + n].tolist() for (i, n), start in zip(rows, starts)])
        assert not batch.is_decode
        logits = runner.run(batch)
        for (i, n), start, row in zip(rows, starts, logits):
            got.append(torch.log_softmax(row.float(), -1)); want.append(ref[i][start + n - 1])
            done[i] = start + n
    got, want = torch.stack(got), torch.stack(want)
    err = (got - want).abs()
    assert torch.isfinite(got).all()
    assert err.max() < 0.25, f"{name}: max |dlogprob| {err.max():.3f}"
    assert err.mean(-1).max() < 0.03, f"{name}: mean |dlogprob| of the worst row {err.mean(-1).max():.4f}"
    top5 = got.topk(5, -1).indices
    assert (top5 == want.argmax(-1, keepdim=True)).any(-1).all(), f"{name}: top-1 outside top-5"


def greedy_seqs(n: int) -> list[Sequence]:
    """n sequences of plain greedy parameters: a runner takes their batch's argmax within the step."""
    return [Sequence(str(i), None, [1], SamplingParams(temperature=0)) for i in range(n)]


@pytest.mark.parametrize("n", [3, 12])
def test_a_greedy_step_takes_the_argmax_within_the_step(model_pair, n):
    """A greedy step leaves each sequence's argmax of the step's own logits in sampled_tokens (row i: sequence i)
    and in the pinned host slot its pending tokens read: for a prefill (eager) and for decode steps replayed from a
    graph with padding rows (3 sequences in the bucket of 4; 12, where these models' lm_head and larger
    projections take cuBLASLt rather than the GEMV: gemv_preferred). The greedy graph's logits are bit-identical
    to the plain graph's for the same step."""
    name, hf, runner = model_pair
    assert runner.use_graphs and runner.model.decode_bucket(n) > n
    gen = torch.Generator().manual_seed(5)
    lengths = (9, 40, 77) if n == 3 else [9 + 7 * i for i in range(n)]
    prompts = [torch.randint(0, runner.model_config.vocab_size, (k,), generator=gen).tolist() for k in lengths]
    tables = Tables()
    ids = [300 + i for i in range(len(prompts))]
    batch = tables.batch(ids, [0] * len(prompts), prompts)
    order = [2, 0, 1] + list(range(n - 1, 2, -1))  # any subset and order of the rows
    tokens = None
    for step in range(6):
        runner.sampled_tokens.fill_(-7)
        torch.cuda.synchronize()  # the core's stream is not ordered after torch's here
        runner.forward(batch, greedy_seqs(n))
        got = runner.sample(order, greedy_seqs(n)).result().token_ids
        torch.cuda.current_stream().wait_stream(runner.stream)
        logits = runner.logits[:n].clone()
        want = logits.float().argmax(-1)
        assert got == want[order].tolist(), f"{name} step {step}"
        assert torch.equal(runner.sampled_tokens[:n].long(), want), f"{name} step {step}"
        if step > 0:  # the same decode step through the plain graph: the same logits, bit for bit
            assert torch.equal(runner.run(batch), logits), f"{name} step {step}: greedy and plain graphs differ"
        batch = tables.batch(ids, [len(p) + step for p in prompts], [[t] for t in want.tolist()])


def test_host_waits_for_the_graph_to_stage_its_metadata(model_pair):
    """A decode graph's first kernel reads the step's metadata from pinned memory: the host may refill that buffer
    (step_views) only once the kernel has run. With the core's stream held behind a sleeping kernel, step_views
    blocks until the graph has started, and garbage written into the buffer afterwards does not reach the step."""
    import time

    name, hf, runner = model_pair
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, runner.model_config.vocab_size, (21,), generator=gen).tolist()
    tables = Tables()
    logits = runner.run(tables.batch([500], [0], [prompt]))
    token = int(logits[0].argmax())
    decode = tables.batch([500], [len(prompt)], [[token]])
    want = runner.run(decode).float().argmax(-1).tolist()  # the same step, nothing held back
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU clock cycles
    runner.stream.wait_event(side.record_event())
    runner.forward(decode, greedy_seqs(1))  # queued behind the sleep: its staging kernel has not run
    start = time.perf_counter()
    views = runner.model.step_views(1, 1)
    waited = time.perf_counter() - start
    for field in ("positions", "context_lens", "block_tables", "input_ids"):
        views[field][:] = 0
    got = runner.sample([0], greedy_seqs(1)).result().token_ids
    assert waited > 0.05, f"{name}: step_views returned after {waited:.3f} s, before the graph staged its metadata"
    assert got == want, f"{name}: the step read metadata written after its launch"
