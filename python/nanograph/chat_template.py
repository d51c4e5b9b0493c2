"""Chat conversations rendered into prompts by the tokenizer's chat template, with vLLM's chat() options."""
from __future__ import annotations


def render_chat(tokenizer, conversation: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> str:
    """One conversation as prompt text: the assistant's turn opened (add_generation_prompt), or the last message
    left open for the model to continue (continue_final_message). A content is a string or a list of text parts."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True: pass "
                         "add_generation_prompt=False to continue the final message")
    return tokenizer.apply_chat_template([_text_message(m) for m in conversation], chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tools=tools, tokenize=False,
                                         **(chat_template_kwargs or {}))


def chat_prompt_token_ids(tokenizer, conversation: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """One conversation rendered with the assistant's turn opened, as token ids (the template writes the special
    tokens, so the tokenizer adds none)."""
    return tokenizer.encode(render_chat(tokenizer, conversation, chat_template_kwargs=chat_template_kwargs),
                            add_special_tokens=False)


def _text_message(message: dict) -> dict:
    """A chat message whose content is a list of text parts, with the parts joined into one string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        raise ValueError("chat() takes text content parts only ({'type': 'text', 'text': ...})")
    return {**message, "content": "".join(part["text"] for part in content)}
