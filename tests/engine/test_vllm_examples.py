"""vLLM's offline examples run as vLLM users write them, with `from vllm import` changed to `from nanograph import`:
basic/basic.py, basic/chat.py (a system message, then a batch of conversations), reproducibility.py and per-request
seeds, llm_engine_example.py's requests (logprobs, prompt_logprobs, n), stop strings, structured_outputs.py (choice,
regex, a pydantic model's JSON schema, a grammar) and LLM.beam_search, on the bundled SmolLM2-135M-Instruct. Each
result's shape and content is checked: against the tokenizer, against the engine's own teacher-forced prompt
logprobs, against a run without the option (stop strings), or against the constraint it was asked to follow."""
import importlib.util
import json
import re
from enum import Enum

import pytest
from pydantic import BaseModel

from nanograph import LLM, SamplingParams
from nanograph.inputs import TokensPrompt
from nanograph.sampling_params import BeamSearchParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

# The examples name Hub models ("facebook/opt-125m", "Qwen/Qwen2.5-3B-Instruct", "meta-llama/Llama-3.2-1B-Instruct");
# tests reach no network, so the model is the default one: None, the bundled SmolLM2-135M-Instruct. Every other
# argument is the examples', except where a comment says why. One LLM serves all of them (each example builds its
# own), with reproducibility.py's seed.
MODEL = None
SEED = 42

# basic/basic.py's prompts.
PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]

# basic/chat.py's conversation.
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]

# Logprobs in the decode steps and in a teacher-forced prefill agree to float32 rounding on the CPU; a GPU runs in
# bfloat16, whose logits differ by a few hundredths between the two.
LOGPROB_TOLERANCE = 0.05

needs_llguidance = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                      reason="structured outputs need the structured extra (llguidance)")


@pytest.fixture(scope="module")
def llm():
    return LLM(model=MODEL, seed=SEED)


def teacher_forced_logprobs(llm, token_ids: list[int]) -> list[float]:
    """The logprob of each of token_ids[1:] after the ones before it, from the engine's prompt logprobs."""
    [output] = llm.generate(TokensPrompt(prompt_token_ids=token_ids), SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
    return [entry[token_id].logprob for token_id, entry in zip(token_ids[1:], output.prompt_logprobs[1:])]


def assert_completion(llm, completion, max_tokens: int = 16):
    """A finished completion whose text is its tokens' text, at most max_tokens long (SamplingParams' default: 16)."""
    assert 0 < len(completion.token_ids) <= max_tokens
    assert completion.finish_reason == ("length" if len(completion.token_ids) == max_tokens else "stop")
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)


def test_basic(llm):
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert [output.prompt for output in outputs] == PROMPTS
    for output in outputs:
        assert output.prompt_token_ids == llm.get_tokenizer().encode(output.prompt)
        [completion] = output.outputs
        assert_completion(llm, completion)
        assert completion.text.strip()
        assert output.finished


def test_chat_with_a_system_message_then_a_batch_of_conversations(llm):
    # chat.py's sampling parameters come from its command line; these are its documented ones, with few tokens.
    sampling_params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95)
    outputs = llm.chat(CONVERSATION, sampling_params, use_tqdm=False)
    [output] = outputs
    rendered = llm.get_tokenizer().apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert output.prompt == rendered
    assert "You are a helpful assistant" in output.prompt  # the system message, not the template's default one
    assert output.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)
    assert_completion(llm, output.outputs[0], max_tokens=8)

    conversations = [CONVERSATION for _ in range(10)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    assert len(outputs) == 10
    for batch_output in outputs:
        assert batch_output.prompt == rendered and batch_output.prompt_token_ids == output.prompt_token_ids
        assert len(batch_output.outputs) == 1
        assert_completion(llm, batch_output.outputs[0], max_tokens=8)
    assert len({tuple(batch_output.outputs[0].token_ids) for batch_output in outputs}) > 1  # sampled, not copied


def test_logprobs_and_prompt_logprobs(llm):
    # llm_engine_example.py's first request.
    prompt, sampling_params = "A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1,
                                                                                     prompt_logprobs=1)
    [output] = llm.generate(prompt, sampling_params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    prompt_token_ids = output.prompt_token_ids
    assert prompt_token_ids == tokenizer.encode(prompt)

    assert len(output.prompt_logprobs) == len(prompt_token_ids) and output.prompt_logprobs[0] is None
    for token_id, entry in zip(prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert token_id in entry and 1 <= len(entry) <= 2  # the prompt's token and the top one
        assert min(logprob.rank for logprob in entry.values()) == 1
        best = max(entry.values(), key=lambda logprob: logprob.logprob)
        assert best.rank == 1 and all(logprob.logprob <= 0 for logprob in entry.values())
        assert entry[token_id].decoded_token == tokenizer.decode([token_id])

    [completion] = output.outputs
    assert_completion(llm, completion)
    assert len(completion.logprobs) == len(completion.token_ids)
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert token_id in entry and len(entry) == 1  # greedy: the sampled token is the top one
        assert entry[token_id].rank == 1 and entry[token_id].decoded_token == tokenizer.decode([token_id])
    sampled = [entry[token_id].logprob for token_id, entry in zip(completion.token_ids, completion.logprobs)]
    assert completion.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-4)
    # The decode steps' logprobs are the prefill's over the prompt and the completion, teacher-forced.
    forced = teacher_forced_logprobs(llm, prompt_token_ids + completion.token_ids)
    assert forced[:len(prompt_token_ids) - 1] == pytest.approx(
        [entry[token_id].logprob for token_id, entry in zip(prompt_token_ids[1:], output.prompt_logprobs[1:])],
        abs=LOGPROB_TOLERANCE)
    assert forced[len(prompt_token_ids) - 1:] == pytest.approx(sampled, abs=LOGPROB_TOLERANCE)


def test_sampled_logprobs_hold_the_sampled_token(llm):
    [output] = llm.generate(PROMPTS[3], SamplingParams(temperature=0.8, top_p=0.95, logprobs=5), use_tqdm=False)
    [completion] = output.outputs
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        # The top 5, and the sampled token when it is not one of them.
        assert token_id in entry and len(entry) == 5 + (entry[token_id].rank > 5)
        assert sorted(logprob.rank for logprob in entry.values())[:5] == [1, 2, 3, 4, 5]


def test_n_gives_n_completions(llm):
    # llm_engine_example.py's third request, without best_of=5: vLLM's V1 engine refuses best_of, as nanograph does.
    prompt = "What is the meaning of life?"
    sampling_params = SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1)
    [output] = llm.generate(prompt, sampling_params, use_tqdm=False)
    assert output.prompt == prompt
    assert [completion.index for completion in output.outputs] == [0, 1]
    for completion in output.outputs:
        assert_completion(llm, completion)
    assert output.outputs[0].token_ids != output.outputs[1].token_ids


def test_the_same_seed_repeats_and_another_seed_differs(llm):
    prompt = PROMPTS[3]
    first, other = llm.generate([prompt, prompt], [SamplingParams(temperature=0.8, top_p=0.95, seed=SEED),
                                                   SamplingParams(temperature=0.8, top_p=0.95, seed=SEED + 1)],
                                use_tqdm=False)
    [again] = llm.generate(prompt, SamplingParams(temperature=0.8, top_p=0.95, seed=SEED), use_tqdm=False)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.outputs[0].text == first.outputs[0].text
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_stop_strings_end_the_text_before_them(llm):
    prompt = PROMPTS[2]
    [free] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    text = free.outputs[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]  # a word in the middle of the greedy text
    [stopped] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop, "never said"]),
                             use_tqdm=False)
    completion = stopped.outputs[0]
    assert stop not in completion.text
    assert completion.text == text[:text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop


# structured_outputs.py's four requests.

class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


SIMPLIFIED_SQL_GRAMMAR = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""


def generate_output(prompt: str, sampling_params: SamplingParams, llm: LLM) -> str:
    outputs = llm.generate(prompts=prompt, sampling_params=sampling_params)
    return outputs[0].outputs[0].text


@needs_llguidance
def test_structured_outputs_by_choice(llm):
    sampling_params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
    output = generate_output("Classify this sentiment: vLLM is wonderful!", sampling_params, llm)
    assert output in ["Positive", "Negative"]


@needs_llguidance
def test_structured_outputs_by_regex(llm):
    sampling_params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), stop=["\n"])
    prompt = ("Generate an email address for Alan Turing, who works in Enigma."
              "End in .com and new line. Example result:"
              "alan.turing@enigma.com\n")
    [output] = llm.generate(prompts=prompt, sampling_params=sampling_params)
    completion = output.outputs[0]
    if completion.finish_reason == "stop":  # at the regex's last "\n", a stop string: the text ends before it
        assert re.fullmatch(r"\w+@\w+\.com", completion.text), completion.text
    else:  # 16 tokens (SamplingParams' default) into a \w+ that a 135M model, sampling, may not end: a prefix
        assert completion.finish_reason == "length" and len(completion.token_ids) == 16
        assert re.fullmatch(r"\w*|\w+@\w*|\w+@\w+\.(c|co|com)?", completion.text), completion.text


@needs_llguidance
def test_structured_outputs_by_json_schema(llm):
    json_schema = CarDescription.model_json_schema()
    # Unlike the example, greedy and 64 tokens: SamplingParams' default 16 tokens cut a car short of its closing
    # brace, and the schema allows more properties than its three, which a 135M model sampling at temperature 1
    # may add without end.
    sampling_params = SamplingParams(structured_outputs=StructuredOutputsParams(json=json_schema), temperature=0,
                                     max_tokens=64)
    prompt = ("Generate a JSON with the brand, model and car_type of"
              "the most iconic car from the 90's")
    output = generate_output(prompt, sampling_params, llm)
    car = CarDescription.model_validate_json(output)
    assert list(json.loads(output))[:3] == ["brand", "model", "car_type"] and car.car_type in CarType


@needs_llguidance
def test_structured_outputs_by_grammar(llm):
    # The query takes about 20 tokens: more than SamplingParams' default 16, which the example keeps.
    sampling_params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=SIMPLIFIED_SQL_GRAMMAR),
                                     max_tokens=32)
    prompt = "Generate an SQL query to show the 'username' and 'email'from the 'users' table."
    output = generate_output(prompt, sampling_params, llm)
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", output), output


def test_beam_search(llm):
    # vLLM's documented call: a list of TextPrompt dicts and BeamSearchParams(beam_width, max_tokens).
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    outputs = llm.beam_search([{"prompt": "Hello, my name is "}], params)
    [output] = outputs
    tokenizer = llm.get_tokenizer()
    prompt_token_ids = tokenizer.encode("Hello, my name is ")
    assert len(output.sequences) == params.beam_width
    assert len({tuple(sequence.tokens) for sequence in output.sequences}) == params.beam_width
    scores = [sequence.cum_logprob / len(sequence.tokens) ** params.length_penalty for sequence in output.sequences]
    assert scores == sorted(scores, reverse=True)  # best first (no beam ended with EOS in 8 tokens)
    best = output.sequences[0]
    assert best.cum_logprob == max(sequence.cum_logprob for sequence in output.sequences)
    for sequence in output.sequences:
        assert sequence.tokens[:len(prompt_token_ids)] == prompt_token_ids
        generated = sequence.tokens[len(prompt_token_ids):]
        assert len(generated) == params.max_tokens and sequence.finish_reason == "length"
        assert sequence.text == tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        assert [token_id in step for token_id, step in zip(generated, sequence.logprobs, strict=True)] == [True] * 8
        assert sequence.cum_logprob == pytest.approx(
            sum(step[token_id].logprob for token_id, step in zip(generated, sequence.logprobs)), abs=1e-4)
        forced = teacher_forced_logprobs(llm, sequence.tokens)[len(prompt_token_ids) - 1:]
        assert sequence.cum_logprob == pytest.approx(sum(forced), abs=LOGPROB_TOLERANCE * len(generated))
