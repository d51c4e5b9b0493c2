"""LLM.chat with vLLM's options, on a tiny random model with SmolLM2's real tokenizer and chat template (CPU): the
rendered prompt is the output's prompt, add_generation_prompt / continue_final_message, a custom template, tools
and template kwargs, TokensPrompt / TextPrompt."""
import pytest
from transformers import AutoTokenizer

from nanograph import LLM, SamplingParams, TextPrompt, TokensPrompt


GREEDY = SamplingParams(temperature=0, max_tokens=5)
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def folder(tiny_chat_folder):
    return tiny_chat_folder


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), device="cpu", max_model_len=256, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder)


def ids(outputs):
    return [out.outputs[0].token_ids for out in outputs]


def test_the_output_prompt_is_the_rendered_conversation(llm, tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    [out] = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert out.prompt == text
    assert out.prompt_token_ids == tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                                                 tokenize=True, return_dict=False)
    assert ids([out]) == ids(llm.generate(TokensPrompt(prompt_token_ids=out.prompt_token_ids), GREEDY,
                                          use_tqdm=False))
    # A batch of conversations, each rendered on its own; text parts are joined by newlines (vLLM's rule).
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                          {"type": "text", "text": "One word."}]}]
    outs = llm.chat([CONVERSATION, parts], GREEDY, use_tqdm=False)
    assert outs[0].prompt == text and outs[1].prompt == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour.\nOne word."}], add_generation_prompt=True, tokenize=False)


def test_add_generation_prompt_and_continue_final_message(llm, tokenizer):
    [closed] = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert closed.prompt == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert not closed.prompt.endswith("assistant\n")
    started = CONVERSATION + [{"role": "assistant", "content": "The colour is"}]
    [continued] = llm.chat(started, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert continued.prompt.endswith("<|im_start|>assistant\nThe colour is")
    assert continued.prompt == tokenizer.apply_chat_template(started, continue_final_message=True, tokenize=False)
    with pytest.raises(ValueError, match="Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                         "True"):
        llm.chat(started, GREEDY, use_tqdm=False, continue_final_message=True)


def test_a_custom_template_with_tools_and_kwargs(llm):
    template = ("{% for tool in tools %}[tool {{ tool.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{{ greeting }}{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                "parameters": {"type": "object", "properties": {}}}}]
    [out] = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=template, tools=tools,
                     chat_template_kwargs={"greeting": "Sure:"})
    assert out.prompt == "[tool get_weather]<system>You are terse.<user>Name a colour.<assistant>Sure:"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)


def test_template_kwargs_win_over_the_options_and_tool_call_turns_render(llm):
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}"
                "[call {{ m.tool_calls[0].function.name }}]{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    turns = [*CONVERSATION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    [out] = llm.chat(turns, GREEDY, use_tqdm=False, chat_template=template,
                     chat_template_kwargs={"add_generation_prompt": False})
    assert out.prompt == "<system>You are terse.<user>Name a colour.<assistant>[call get_weather]<tool>sunny"
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set tokenize"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template_kwargs={"tokenize": True})



LOOPING = "{% for m in messages %}<{{ m.role }}>{% for part in m['content'] %}{{ part.text }}|{% endfor %}{% endfor %}"
SET_THEN_LOOPING = ("{% for m in messages %}{% set parts = m.content %}<{{ m.role }}>"
                    "{% for part in parts %}{{ part['text'] }}|{% endfor %}{% endfor %}")
FILTERED = ("{% for m in messages %}<{{ m.role }}>"
            "{% for part in m['content'] | selectattr('type', 'equalto', 'text') %}{{ part.text }}|{% endfor %}"
            "{% endfor %}")


@pytest.mark.parametrize("template", [LOOPING, SET_THEN_LOOPING, FILTERED], ids=["loop", "set_then_loop", "filtered"])
def test_a_template_that_loops_over_the_content_gets_it_as_parts(llm, template):
    """vLLM's chat_template_content_format: "auto" gives a template that iterates over a message's content the list
    of text parts (a string content as one part, text parts as they are), where joining them into one string left
    it nothing to print; "string" forces the joined string (over which such a template loops by character), and
    "openai" the parts to any template. The same for vLLM's argument order, positional."""
    conversation = [{"role": "system", "content": "Be terse."},
                    {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "you"}]}]
    [out] = llm.chat(conversation, GREEDY, False, None, template)
    assert out.prompt == "<system>Be terse.|<user>hello|you|"
    [forced] = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=template,
                        chat_template_content_format="string")
    # Each character of the string is a "part" without text: the text is lost, as it was before "auto".
    assert forced.prompt.startswith("<system>") and "terse" not in forced.prompt and "hello" not in forced.prompt
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    [as_string] = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=plain)
    assert as_string.prompt == "<system>Be terse.<user>hello\nyou"
    [as_parts] = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=plain,
                          chat_template_content_format="openai")
    assert as_parts.prompt == "<system>[{'type': 'text', 'text': 'Be terse.'}]<user>[{'type': 'text', 'text': " \
        "'hello'}, {'type': 'text', 'text': 'you'}]"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_content_format="parts")
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat(conversation, GREEDY, use_tqdm=False, mm_processor_kwargs={})


def test_the_default_template_takes_contents_as_strings(llm, tokenizer):
    """SmolLM2's template prints the content: "auto" keeps it a string (a list of parts would print as a list)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    [out] = llm.chat(parts, GREEDY, use_tqdm=False)
    assert out.prompt == tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                                       add_generation_prompt=True, tokenize=False)

def test_image_parts_are_refused(llm):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(ValueError, match=r"chat\(\) takes text content parts only"):
        llm.chat(image, GREEDY, use_tqdm=False)


def test_text_and_tokens_prompts(llm, tokenizer):
    text = "The sky is"
    [by_text] = llm.generate(TextPrompt(prompt=text), GREEDY, use_tqdm=False)
    assert by_text.prompt == text and by_text.prompt_token_ids == tokenizer.encode(text)
    [by_ids] = llm.generate(TokensPrompt(prompt_token_ids=tokenizer.encode(text)), GREEDY, use_tqdm=False)
    assert by_ids.prompt is None and ids([by_ids]) == ids([by_text])
    with pytest.raises(ValueError, match="multi_modal_data is not supported"):
        llm.generate(TextPrompt(prompt=text, multi_modal_data={"image": None, "audio": [b"..."]}), GREEDY,
                     use_tqdm=False)
