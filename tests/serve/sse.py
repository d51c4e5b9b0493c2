"""Raw SSE framing, read with httpx: what an OpenAI stream must look like on the wire."""
import json

import httpx


def stream_events(base_url: str, path: str, body: dict, headers: dict | None = None) -> list:
    """POST a streamed request and return its events' JSON payloads, the final [DONE] checked and left out; every
    event must be one `data: ` line followed by a blank line."""
    response = httpx.post(base_url + path, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "", "the stream must end with a blank line"
    lines = blocks[:-1]
    assert all(line.startswith("data: ") and "\n" not in line for line in lines), lines
    assert lines[-1] == "data: [DONE]" and "data: [DONE]" not in lines[:-1]
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def check_finish_reasons(chunks: list, num_choices: int) -> dict:
    """Each choice's finish_reason is set on its last chunk only; returns {index: finish_reason}."""
    by_index = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_index.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert sorted(by_index) == list(range(num_choices))
    for index, reasons in by_index.items():
        assert reasons[-1] is not None and all(reason is None for reason in reasons[:-1]), (index, reasons)
    return {index: reasons[-1] for index, reasons in by_index.items()}
