"""The span's response: the stream accumulator rebuilds the answer a non-streamed call would have given, and
the response logprobs line up with the response token ids."""

from __future__ import annotations

from typing import Any

from rollway.gateway.record import response_logprobs
from rollway.gateway.streaming import StreamAccumulator


def chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> dict[str, Any]:
    body = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": None, **choice}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [body]}


def test_reasoning_refusal_and_stop_reason_survive_streaming() -> None:
    acc = StreamAccumulator("chat")
    for piece in [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "Let me "}),
        chunk({"reasoning_content": "think.", "content": None}),
        chunk({"content": "4"}),
        chunk({"content": "2"}),
        chunk({"refusal": None}, "stop", stop_reason=128009),
    ]:
        acc.feed(piece)
    [choice] = acc.response()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "42", "reasoning_content": "Let me think."}
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 128009)


def test_a_streamed_refusal_is_kept_and_other_delta_fields_keep_their_last_value() -> None:
    acc = StreamAccumulator("chat")
    for piece in [
        chunk({"role": "assistant", "refusal": "I can"}),
        chunk({"refusal": "not help.", "annotations": [{"type": "x", "n": 1}]}),
        chunk({"annotations": [{"type": "x", "n": 2}]}, "stop"),
    ]:
        acc.feed(piece)
    message = acc.response()["choices"][0]["message"]
    assert message["refusal"] == "I cannot help."
    assert message["content"] is None
    assert message["annotations"] == [{"type": "x", "n": 2}]


def test_text_completion_choices_keep_their_extra_fields() -> None:
    acc = StreamAccumulator("text_completion")
    acc.feed({"id": "cmpl-1", "choices": [{"index": 0, "text": "a", "stop_reason": None, "finish_reason": None}]})
    acc.feed({"id": "cmpl-1", "choices": [{"index": 0, "text": "b", "stop_reason": "</s>", "finish_reason": "stop"}]})
    [choice] = acc.response()["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("ab", "stop", "</s>")


def test_echoed_prompt_logprobs_are_not_the_responses() -> None:
    """vLLM's ``echo``: the prompt's logprobs (first null) come before the generated tokens', while
    ``token_ids`` holds the generated ones only; the span's response logprobs line up with those."""
    choice = {"text": "2 + 2 = 4", "token_ids": [19], "logprobs": {"token_logprobs": [None, -1.5, -0.25, -0.125]}}
    assert response_logprobs("text_completion", choice) == [-0.125]
    plain = {"text": "4", "token_ids": [19, 2], "logprobs": {"token_logprobs": [-0.125, -0.5]}}
    assert response_logprobs("text_completion", plain) == [-0.125, -0.5]


def test_a_streamed_legacy_function_call_is_merged() -> None:
    acc = StreamAccumulator("chat")
    for piece in [
        chunk({"role": "assistant", "function_call": {"name": "get_weather", "arguments": ""}}),
        chunk({"function_call": {"arguments": '{"city": '}}),
        chunk({"function_call": {"arguments": '"Paris"}'}}, "function_call"),
    ]:
        acc.feed(piece)
    message = acc.response()["choices"][0]["message"]
    assert message["function_call"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_field_of_the_finishing_chunk_survives_a_chunk_after_it() -> None:
    """SGLang with hidden states sends one more chunk after the finishing one, its matched_stop null."""
    acc = StreamAccumulator("chat")
    acc.feed(chunk({"role": "assistant", "content": "4"}))
    acc.feed(chunk({}, "stop", matched_stop=151645))
    acc.feed(chunk({}, None, matched_stop=None, hidden_states=[0.5]))
    [choice] = acc.response()["choices"]
    assert (choice["finish_reason"], choice["matched_stop"], choice["hidden_states"]) == ("stop", 151645, [0.5])
