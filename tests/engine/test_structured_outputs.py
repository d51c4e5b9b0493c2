"""Structured outputs and bad_words end to end on the torch backend (CPU) with the bundled SmolLM2-135M-Instruct: a
JSON schema, a regex, a choice and a JSON object come out as asked, per sequence with n > 1, in a batch whose
unconstrained requests give exactly what they give alone."""
import json
import re

import pytest

from nanograph import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
PHONE = r"\d{3}-\d{4}"
CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=256, max_num_seqs=16)


def constrained(spec: StructuredOutputsParams, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, **kwargs}, structured_outputs=spec)


def assert_person(text: str):
    person = json.loads(text)
    assert list(person) == ["name", "age"]  # the schema's order
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150


def test_a_mixed_batch_follows_each_constraint_and_leaves_the_others_alone(llm):
    free = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.8, seed=3, max_tokens=8)]
    requests = [
        ("Describe a person as JSON.", constrained(StructuredOutputsParams(json=PERSON))),
        ("Describe a person as JSON.", constrained(StructuredOutputsParams(json=json.dumps(PERSON)), n=2,
                                                   temperature=1.0, seed=7)),
        ("Call me at", constrained(StructuredOutputsParams(regex=PHONE), max_tokens=12)),
        ("Is the sky blue? Answer:", SamplingParams(temperature=0, max_tokens=4,
                                                    guided_decoding=GuidedDecodingParams(choice=CHOICES))),
        ("A JSON object:", constrained(StructuredOutputsParams(json_object=True), max_tokens=64)),
        ("The capital of France is", SamplingParams(temperature=0, max_tokens=6, bad_words=["Paris"])),
        ("The capital of France is", free[0]),
        ("Once upon a time", free[1]),
    ]
    outputs = llm.generate([prompt for prompt, _ in requests], [params for _, params in requests], use_tqdm=False)
    person, people, phone, choice, json_object, no_paris, paris, story = outputs
    assert_person(person.outputs[0].text)
    assert person.outputs[0].finish_reason == "stop"  # the grammar ends with the end of the object
    assert len(people.outputs) == 2
    for completion in people.outputs:
        assert_person(completion.text)
    assert re.fullmatch(PHONE, phone.outputs[0].text)
    assert choice.outputs[0].text in CHOICES
    assert isinstance(json.loads(json_object.outputs[0].text), dict)
    assert "Paris" in paris.outputs[0].text and "Paris" not in no_paris.outputs[0].text
    alone = llm.generate([requests[-2][0], requests[-1][0]], free, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in alone] == [paris.outputs[0].token_ids, story.outputs[0].token_ids]


def test_vllms_json_options_compact_json_and_no_other_properties(llm):
    """disable_any_whitespace: no whitespace between JSON tokens; disable_additional_properties: an object schema that
    says nothing of other properties takes none; backend (vLLM's older GuidedDecodingParams) is taken and changes
    nothing."""
    schema = {"type": "object", "required": ["name", "city"],
              "properties": {"name": {"type": "string", "maxLength": 8}, "city": {"type": "string", "maxLength": 8}}}
    options = dict(disable_any_whitespace=True, disable_additional_properties=True)
    outputs = llm.generate(["Describe a person as JSON, with spaces: { \"name\" : "] * 2, [
        constrained(StructuredOutputsParams(json=schema, **options), max_tokens=48),
        SamplingParams(temperature=0, max_tokens=48, guided_decoding=GuidedDecodingParams(
            json=json.dumps(schema), backend="xgrammar", disable_fallback=True, **options))], use_tqdm=False)
    texts = [output.outputs[0].text for output in outputs]
    assert texts[0] == texts[1]
    person = json.loads(texts[0])
    assert list(person) == ["name", "city"]
    assert texts[0] == json.dumps(person, separators=(",", ":"), ensure_ascii=False)
    spec = StructuredOutputsParams(json={**schema, "properties": {**schema["properties"], "meta": {
        "type": "object"}}}, disable_additional_properties=True).spec()
    compiled = json.loads(spec[1])
    # An object schema with properties takes no others; a free-form object (and json_object) stays free.
    assert compiled["additionalProperties"] is False and compiled["properties"]["meta"] == {"type": "object"}
    assert StructuredOutputsParams(json_object=True, disable_additional_properties=True).spec()[1] == \
        '{"type": "object"}'
    with pytest.raises(ValueError, match="structured_outputs.disable_any_whitespace must be true or false"):
        StructuredOutputsParams(json=schema, disable_any_whitespace="false")
    with pytest.raises(ValueError, match="structural_tag is not supported"):
        StructuredOutputsParams(structural_tag='{"structures": []}')


def test_a_bad_schema_is_refused_naming_the_field(llm):
    with pytest.raises(ValueError, match="request 1: structured_outputs.json is not a valid json schema"):
        llm.generate(["a", "b"], [SamplingParams(), constrained(StructuredOutputsParams(json={"type": 5}))],
                     use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.engine.add_request("a", constrained(StructuredOutputsParams(regex="[a-")))
    assert not llm.engine.has_unfinished()


def test_a_grammar_that_ends_before_min_tokens_ends_the_output(llm):
    """min_tokens holds back the end of text, but a grammar that has ended allows nothing else: the grammar's end
    comes first, and the output is the choice, finished by "stop" (greedy and sampled)."""
    prompts = ["Is the sky blue? Answer:"] * 2
    params = [constrained(StructuredOutputsParams(choice=CHOICES), min_tokens=5),
              constrained(StructuredOutputsParams(choice=CHOICES), min_tokens=5, temperature=0.9, seed=2)]
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.text in CHOICES and completion.finish_reason == "stop"
        assert len(completion.token_ids) < 5


def test_a_choice_of_thousands_with_regex_characters_gives_one_of_them(llm):
    """A choice is matched as literal text (a regex's special characters too), and a list of thousands of choices
    (more than llguidance's own choice rule takes) is served, greedy and sampled."""
    specials = ["a.b", "a+b", r"x\y", "(q)|[r]{2}^$ #&~-", "what?*"]
    many = [f"option {i}" for i in range(2500)] + specials
    prompts = ["Pick one:", "Pick one:", "Pick an option:"]
    params = [constrained(StructuredOutputsParams(choice=specials), max_tokens=16),
              constrained(StructuredOutputsParams(choice=specials), max_tokens=16, temperature=1.0, seed=5),
              constrained(StructuredOutputsParams(choice=many), max_tokens=16, temperature=1.0, seed=1)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out, allowed in zip(outputs, [specials, specials, many]):
        completion = out.outputs[0]
        assert completion.text in allowed and completion.finish_reason == "stop", completion.text


@pytest.mark.parametrize("masked", [
    dict(structured_outputs=StructuredOutputsParams(choice=[" hello"]), bad_words=["hello"]),
    dict(structured_outputs=StructuredOutputsParams(regex="hello"), allowed_token_ids=[2]),
])
@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_request_whose_every_token_is_masked_fails_alone(llm, masked, logprobs):
    """A grammar with bad_words or allowed_token_ids can leave no token at all (intake cannot see it coming): that
    request samples an id past the vocabulary and fails with a message naming the cause, while the request decoding
    beside it (sampled, with its own logprobs) gives exactly its tokens of a run alone, and no block is lost."""
    engine = llm.engine
    free = engine.scheduler.block_manager.num_free_blocks
    good = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, logprobs=logprobs)
    bad = SamplingParams(temperature=1.0, max_tokens=4, logprobs=logprobs, **masked)
    alone = llm.generate(["The city of"], good, use_tqdm=False)[0].outputs[0]
    good_id = engine.add_request("The city of", good)
    engine.step()  # the good request is decoding when the other one arrives
    bad_id = engine.add_request("Say", bad)
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    assert outputs[good_id].error is None
    assert outputs[good_id].outputs[0].token_ids == alone.token_ids
    assert outputs[good_id].outputs[0].finish_reason == "length"
    if logprobs:  # the same tokens and ranks; the values as close as a batch of two allows
        for ours, theirs in zip(outputs[good_id].outputs[0].logprobs, alone.logprobs, strict=True):
            assert {t: p.rank for t, p in ours.items()} == {t: p.rank for t, p in theirs.items()}
            assert [p.logprob for p in ours.values()] == pytest.approx([p.logprob for p in theirs.values()], abs=1e-4)
    assert outputs[bad_id].outputs[0].finish_reason == "abort"
    assert "every token was masked" in outputs[bad_id].error
    assert engine.scheduler.block_manager.num_free_blocks == free


def test_a_grammar_llguidance_cannot_follow_fails_alone_naming_it(llm):
    """A regex that llguidance accepts but cannot follow once tokens arrive (nested repetitions past its lexer's
    limit): that request ends with an error naming the grammar and what to change, not as a token its grammar does
    not allow; the request beside it gives its tokens of a run alone, and no block is lost."""
    engine = llm.engine
    free = engine.scheduler.block_manager.num_free_blocks
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["The city of"], good, use_tqdm=False)[0].outputs[0]
    good_id = engine.add_request("The city of", good)
    bad_id = engine.add_request("Say", constrained(StructuredOutputsParams(regex="((a{100}){100}){100}")))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    assert outputs[good_id].error is None and outputs[good_id].outputs[0].token_ids == alone.token_ids
    assert outputs[bad_id].outputs[0].finish_reason == "abort"
    assert outputs[bad_id].error.startswith("StructuredOutputError: structured_outputs: llguidance cannot follow")
    assert "too many expressions" in outputs[bad_id].error
    assert engine.scheduler.block_manager.num_free_blocks == free
