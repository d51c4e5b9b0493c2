"""logit_bias, allowed_token_ids, bad_words and the grammar bitmask in the sampler (the torch path), against
reference computations on random logits; and their checks at intake."""
import numpy as np
import pytest
import torch

from nanograph import SamplingParams, StructuredOutputsParams
from nanograph.config import Config
from nanograph.engine.intake import Intake
from nanograph.sampling import Sampler
from nanograph.sampling.grammar import GrammarCompiler, bitmask_words

from .test_api_sampler import CHI2_CRITICAL_0_001, EOS, chi_square, reference_penalties, sample, seq

VOCAB = 300


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def random_biases(rows: int, seed: int, vocab: int = VOCAB, per_row: int = 6) -> list[dict[int, float]]:
    generator = torch.Generator().manual_seed(seed)
    return [dict(zip(torch.randperm(vocab, generator=generator)[:per_row].tolist(),
                     (torch.rand(per_row, generator=generator) * 14 - 4).tolist())) for _ in range(rows)]


def biased(row: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    row = row.clone()
    row[list(bias)] += torch.tensor(list(bias.values()))
    return row


class FixedGrammar:
    """A grammar stand-in that allows the same tokens at every step: bitmask words (int32 [words])."""
    applies = True

    def __init__(self, words: np.ndarray):
        self.words = words

    def fill(self, bitmask: np.ndarray, row: int):
        bitmask[row] = self.words


def random_bitmask(rows: int, seed: int, vocab: int = VOCAB, allowed_share: float = 0.1) -> torch.Tensor:
    """bool [rows, vocab]: the allowed tokens, at least one per row."""
    allowed = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed)) < allowed_share
    allowed[:, 0] |= ~allowed.any(dim=-1)
    return allowed


def packed_bits(allowed: torch.Tensor) -> np.ndarray:
    """int32 [rows, words]: allowed ([rows, vocab] bool) as bitmask rows, bit t % 32 of word t // 32."""
    rows, vocab = allowed.shape
    bits = np.zeros((rows, bitmask_words(vocab) * 32), np.uint8)
    bits[:, :vocab] = allowed.numpy()
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


@pytest.mark.parametrize("penalised", [False, True])
def test_logit_bias_moves_the_greedy_choice_to_the_biased_argmax(penalised):
    """The bias is added before the penalties (vLLM's order); the reference adds it, then penalises."""
    rows, prompt, output = 48, [5, 17, 40], [17, 99]
    logits = random_logits(rows, seed=1)
    biases = random_biases(rows, seed=2)
    if penalised:  # biases on seen tokens too, where the order of bias and penalties matters
        seen_biases = torch.rand(rows, 2, generator=torch.Generator().manual_seed(3)) * 8 + 2
        biases = [{**bias, 17: float(b17), 40: float(b40)} for bias, (b17, b40) in zip(biases, seen_biases)]
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.8) if penalised else {}
    seqs = [seq(SamplingParams(temperature=0, logit_bias=bias, **penalties), prompt, output) for bias in biases]
    expected = [int(reference_penalties(biased(logits[r], biases[r]), prompt, output, 0.5, 0.3, 1.8).argmax()
                    if penalised else biased(logits[r], biases[r]).argmax()) for r in range(rows)]
    assert sample(logits, seqs).token_ids == expected
    assert sum(e != int(a) for e, a in zip(expected, logits.argmax(dim=-1))) > rows // 4  # the biases mattered


def test_logit_bias_is_clamped_and_keyed_by_token_id():
    assert SamplingParams(logit_bias={"7": 250, 3: -1e9}).logit_bias == {7: 100.0, 3: -100.0}
    assert SamplingParams(logit_bias={"-0": 1.0, "12": 2.0}).logit_bias == {0: 1.0, 12: 2.0}
    for key in ("seven", "--5", "5-", "\u00b2", "1.5", " 3", ""):  # "²" and "--5" pass str.isdigit-style checks
        with pytest.raises(ValueError, match=r"logit_bias keys must be token ids \(ints\)"):
            SamplingParams(logit_bias={key: 1.0})


def test_allowed_token_ids_draw_only_those_tokens_with_their_renormalised_softmax():
    allowed, bias = [3, 50, 51, 200, 299], {50: 1.5, 7: 50.0}  # 7: outside allowed_token_ids, still masked
    logits = random_logits(1, seed=3)[0]
    params = SamplingParams(temperature=1.0, allowed_token_ids=allowed, logit_bias=bias)
    draws = torch.tensor(sample(logits.repeat(4000, 1), [seq(params) for _ in range(4000)]).token_ids)
    assert set(draws.tolist()) <= set(allowed)
    probs = torch.zeros(VOCAB, dtype=torch.float64)
    probs[allowed] = biased(logits, {50: 1.5})[allowed].double().softmax(dim=-1)
    assert chi_square(draws, probs) < CHI2_CRITICAL_0_001[4]


def test_allowed_token_ids_greedy_is_the_argmax_among_them():
    logits = random_logits(16, seed=4)
    generator = torch.Generator().manual_seed(5)
    allowed = [torch.randperm(VOCAB, generator=generator)[:8].tolist() for _ in range(16)]
    seqs = [seq(SamplingParams(temperature=0, allowed_token_ids=ids)) for ids in allowed]
    assert sample(logits, seqs).token_ids == [ids[int(logits[r, ids].argmax())] for r, ids in enumerate(allowed)]


def test_bad_words_mask_their_last_token_after_their_prefix():
    """A one-token word is always masked; a longer one only where the output ends with its other tokens (the
    prompt does not count)."""
    logits = random_logits(6, seed=6)
    logits[:, 9] = 100  # the favourite everywhere
    words = [[9], [4, 9], [5, 4, 9]]
    cases = [  # (words, prompt, output, masked)
        (words[:1], [1], [], True),
        (words[1:2], [1], [7, 4], True),
        (words[1:2], [4], [], False),  # the prefix is in the prompt: not masked
        (words[1:2], [1], [4, 7], False),
        (words[2:], [1], [5, 4], True),
        (words[2:], [1], [6, 4], False)]
    seqs = []
    for bad_words, prompt, output, _ in cases:
        s = seq(SamplingParams(temperature=0), prompt, output)
        s.bad_words_token_ids = bad_words
        seqs.append(s)
    second = logits.clone()
    second[:, 9] = float("-inf")
    expected = [int(second[r].argmax()) if masked else 9 for r, (*_, masked) in enumerate(cases)]
    assert sample(logits, seqs).token_ids == expected


def test_logprobs_of_a_biased_row_are_the_raw_ones():
    """As vLLM's default (raw_logprobs): before logit_bias, allowed_token_ids and bad_words."""
    logits = random_logits(1, seed=7)
    s = seq(SamplingParams(temperature=0, logit_bias={11: 100.0}, allowed_token_ids=[11, 12], logprobs=2))
    s.bad_words_token_ids = [[12]]
    out = sample(logits, [s])
    raw = logits[0].log_softmax(dim=-1)
    assert out.token_ids == [11]
    assert out.logprobs[0].logprobs[0] == pytest.approx(float(raw[11]), abs=1e-5)
    assert out.logprobs[0].token_ids[1:] == raw.topk(2).indices.tolist()


def test_the_grammar_bitmask_masks_its_rows_in_place_and_leaves_the_others():
    """Constrained rows draw only allowed tokens (greedy: the allowed argmax); their logits become -inf where the
    bitmask says no and stay as they were elsewhere; unconstrained rows draw what they draw alone."""
    rows = 24
    logits = random_logits(rows, seed=8)
    allowed = random_bitmask(rows, seed=9)
    words = packed_bits(allowed)
    constrained = [r % 3 != 2 for r in range(rows)]
    params = [SamplingParams(temperature=0) if r % 2 else SamplingParams(temperature=1.0, seed=r)
              for r in range(rows)]
    seqs = [seq(p) for p in params]
    for r, s in enumerate(seqs):
        if constrained[r]:
            s.grammar = FixedGrammar(words[r])
    masked = logits.clone()
    out = sample(masked, seqs)
    for r in range(rows):
        if constrained[r]:
            assert torch.equal(masked[r], logits[r].masked_fill(~allowed[r], float("-inf")))
            assert allowed[r, out.token_ids[r]]
            if params[r].temperature == 0:
                assert out.token_ids[r] == int(masked[r].argmax())
        else:
            assert torch.equal(masked[r], logits[r])
    free = [r for r in range(rows) if not constrained[r]]
    alone = sample(logits[free], [seq(params[r]) for r in free]).token_ids
    assert [out.token_ids[r] for r in free] == alone



@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=5),
                                    dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, min_p=0.1),
                                    dict(temperature=1.0, top_k=50, top_p=0.8, min_p=0.01),
                                    dict(temperature=1.0, top_k=5, seed=None)],
                         ids=["greedy", "full", "top_k", "top_p", "min_p", "all", "top_k_unseeded"])
def test_a_row_whose_every_token_is_masked_gets_the_id_past_the_vocabulary(params):
    """A grammar that allows nothing: that row gets the id past the vocabulary (on which the engine fails its
    request), whatever truncates it, and with logprobs on; the other rows get exactly their tokens and logprobs of
    the batch without the mask."""
    rows, masked = 5, 2
    logits = random_logits(rows, seed=12) * 2
    nothing = packed_bits(torch.zeros(1, VOCAB, dtype=torch.bool))[0]

    def run(mask: bool):
        seqs = [seq(SamplingParams(**{"seed": r, "logprobs": 2, **params})) for r in range(rows)]
        if mask:
            seqs[masked].grammar = FixedGrammar(nothing)
        return Sampler("cpu", [EOS], 0).sample(logits.clone(), seqs).result()

    plain, with_mask = run(False), run(True)
    others = [r for r in range(rows) if r != masked]
    assert with_mask.token_ids[masked] == VOCAB
    assert [with_mask.token_ids[r] for r in others] == [plain.token_ids[r] for r in others]
    assert [with_mask.logprobs[r] for r in others] == [plain.logprobs[r] for r in others]

CONSTRAINTS = {"logit_bias": dict(logit_bias={1: 1.0}), "allowed_token_ids": dict(allowed_token_ids=[1, 2]),
               "bad_words": {}, "grammar": {}}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_rows_do_not_take_the_plain_argmax(kind):
    s = seq(SamplingParams(temperature=0, **CONSTRAINTS[kind]))
    if kind == "bad_words":
        s.bad_words_token_ids = [[1]]
    if kind == "grammar":
        s.grammar = FixedGrammar(np.zeros(bitmask_words(VOCAB), np.int32))
    sampler = Sampler(torch.device("cpu"), [EOS])
    assert sampler.plain_greedy([seq(SamplingParams(temperature=0))], VOCAB)
    assert not sampler.plain_greedy([seq(SamplingParams(temperature=0)), s], VOCAB)


@pytest.fixture(scope="module")
def intake():
    pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")
    from transformers import AutoTokenizer

    from nanograph.default_model import default_model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    except Exception as exc:  # the default model's package is not installed
        pytest.skip(f"no default model: {exc}")
    return Intake(Config(max_model_len=4096), len(tokenizer), 4096, tokenizer, [tokenizer.eos_token_id])


@pytest.mark.parametrize("params, field", [
    (SamplingParams(logit_bias={49152: 1.0}), "logit_bias holds token id 49152, outside the vocabulary"),
    (SamplingParams(logit_bias={-1: 1.0}), "logit_bias holds token id -1"),
    (SamplingParams(allowed_token_ids=[5, 60000]), "allowed_token_ids holds token id 60000"),
    (SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nonsense"})),
     "structured_outputs.json is not a valid json schema"),
    (SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab")), "structured_outputs.regex"),
    (SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: undefined_rule")),
     "structured_outputs.grammar"),
])
def test_bad_constraints_are_refused_at_intake_naming_the_field(intake, params, field):
    with pytest.raises(ValueError, match=field):
        intake.validate("hi", params)


@pytest.mark.parametrize("make, message", [
    (lambda: SamplingParams(allowed_token_ids=[]), "allowed_token_ids is not None and empty"),
    (lambda: SamplingParams(bad_words=["ok", " "]), "bad_words"),
    (lambda: StructuredOutputsParams(json={}, regex="a"), "exactly one of .*got json, regex"),
    (lambda: StructuredOutputsParams(), "exactly one of .*got none"),
    (lambda: StructuredOutputsParams(choice=[]), "choice"),
    (lambda: SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                            guided_decoding=StructuredOutputsParams(regex="b")), "not both"),
])
def test_bad_constraint_parameters_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_allowed_token_ids_that_leave_nothing_to_sample_are_refused_at_intake(intake):
    paris, spaced_paris = (intake.tokenizer.encode(text, add_special_tokens=False)[0] for text in ("Paris", " Paris"))
    with pytest.raises(ValueError, match=r"allowed_token_ids \[.*\] are all banned by bad_words"):
        intake.validate("hi", SamplingParams(allowed_token_ids=[paris, spaced_paris], bad_words=["Paris"]))
    eos = intake.eos_token_ids[0]
    with pytest.raises(ValueError, match="min_tokens=2 holds back EOS and stop_token_ids"):
        intake.validate("hi", SamplingParams(allowed_token_ids=[eos, 7], stop_token_ids=[7], min_tokens=2))
    # One token left is enough, and so is EOS alone without min_tokens.
    intake.validate("hi", SamplingParams(allowed_token_ids=[paris, 5], bad_words=["Paris"]))
    intake.validate("hi", SamplingParams(allowed_token_ids=[eos]))


def test_bad_words_are_tokenized_with_and_without_a_leading_space(intake):
    tokenizer = intake.tokenizer
    valid = intake.validate("hi", SamplingParams(bad_words=["Paris", " London"]))
    paris, spaced_paris, london, spaced_london = (tokenizer.encode(text, add_special_tokens=False)
                                                  for text in ("Paris", " Paris", "London", " London"))
    # Each one token alone and spaced, here: the spaced form is another token, so both are banned.
    assert all(len(word) == 1 for word in (paris, spaced_paris, london, spaced_london))
    assert valid.bad_words_token_ids == [paris, spaced_paris, london, spaced_london]


def test_guided_decoding_is_structured_outputs():
    spec = StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams(guided_decoding=spec).structured_outputs == spec


def test_the_compiled_grammars_kept_are_the_most_recently_used(intake):
    compiler = GrammarCompiler(intake.tokenizer, intake.vocab_size, intake.eos_token_ids, max_compiled=2)
    specs = [StructuredOutputsParams(regex=f"a{{{i}}}") for i in (1, 2, 3)]
    first = compiler.compile(specs[0])
    compiler.compile(specs[1])
    assert compiler.compile(specs[0]) is first  # kept, and now the most recent
    compiler.compile(specs[2])  # drops specs[1], the least recently used
    assert list(compiler._compiled) == [specs[0].spec(), specs[2].spec()]


def test_prepare_makes_the_grammar_tokenizer_before_the_first_request(intake, monkeypatch):
    """prepare() builds llguidance's tokenizer once (a server calls it before it reports ready); compiling a spec
    afterwards reuses it."""
    import llguidance.hf

    calls = []
    build = llguidance.hf.from_tokenizer
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: calls.append(1) or build(*a, **k))
    compiler = GrammarCompiler(intake.tokenizer, intake.vocab_size, intake.eos_token_ids)
    assert compiler.prepare() and len(calls) == 1
    compiler.compile(StructuredOutputsParams(regex="ab+"))
    assert len(calls) == 1
    assert not GrammarCompiler(None, intake.vocab_size, intake.eos_token_ids).prepare()  # no tokenizer: nothing
    # A tokenizer llguidance refuses (not a fast one) leaves the error to the structured requests: no exception.
    from .fake_model import FakeTokenizer

    assert not GrammarCompiler(FakeTokenizer(), intake.vocab_size, intake.eos_token_ids).prepare()
