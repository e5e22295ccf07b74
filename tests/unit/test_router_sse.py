"""SSE re-emission of a non-streaming answer (stream_capture: buffered)."""

from __future__ import annotations

import json

from openai.types.chat import ChatCompletionChunk
from openai.types.completion import Completion

from kvtier.router.sse import DONE, chat_events, completion_events

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def parse(events):
    out = list(events)
    assert out[-1] == DONE
    return [json.loads(e[len(b"data: "):]) for e in out[:-1]]


def test_chat_answer_becomes_openai_chunks_with_usage():
    resp = {"id": "c1", "object": "chat.completion", "created": 1, "model": "tiny",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"},
                         "finish_reason": "length"}], "usage": USAGE}
    chunks = [ChatCompletionChunk.model_validate(c) for c in parse(chat_events(resp, True))]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "a b c"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == 8 and chunks[-1].choices == []
    assert all(c.usage is None for c in chunks[:-1])


def test_no_usage_chunk_unless_asked():
    resp = {"id": "c1", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": "xyz", "finish_reason": "stop"}], "usage": USAGE}
    chunks = parse(completion_events(resp, False))
    assert len(chunks) == 1 and chunks[0]["choices"][0]["text"] == "xyz"
    Completion.model_validate({**chunks[0], "object": "text_completion"})


def test_a_responses_event_is_cleaned_typed_and_its_id_read() -> None:
    from kvtier.router.sse import clean_named_event

    created = (b'event: response.created\ndata: {"type":"response.created","response":'
               b'{"id":"resp_1","kv_transfer_params":{"remote_host":"10.0.0.9"}}}')
    out, kind, rid = clean_named_event(created)
    assert (kind, rid) == ("response.created", "resp_1")
    assert b"kv_transfer_params" not in out and out.endswith(b"\n\n")
    # a delta is relayed as it came (not re-encoded), typed by its event line
    delta = b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta"}'
    assert clean_named_event(delta) == (delta + b"\n\n", "response.output_text.delta", None)
    # no event line: typed from the data
    assert clean_named_event(b'data: {"type":"response.completed"}')[1] == "response.completed"
    # a data line that names the params but is not JSON is dropped, never leaked
    out, _, _ = clean_named_event(b'event: x\ndata: {"kv_transfer_params": broken')
    assert b"kv_transfer_params" not in out
