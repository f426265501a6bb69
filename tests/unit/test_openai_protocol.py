"""Request validation: every bad body is a 400 naming its ``param``; good bodies normalise."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvroute.openai_api.errors import APIError, error_type_for_status, model_not_found
from kvroute.openai_api.schema import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def error_of(cls: type, body: bytes) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_request(cls, body)
    assert caught.value.status == 400
    assert caught.value.type == "invalid_request_error"
    return caught.value


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b'{"model": "m", "messages": [', None, None),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}', None, None),
        (b"\xff\xfe", None, None),
        (b"", None, None),
        (b'[{"model": "m"}]', None, "invalid_type"),
        (json.dumps({"messages": USER}).encode(), "model", "missing_required_parameter"),
        (json.dumps({"model": "m"}).encode(), "messages", "missing_required_parameter"),
        (chat(messages=[]), "messages", "empty_array"),
        (chat(messages="hi"), "messages", "invalid_type"),
        (chat(model=3), "model", "invalid_type"),
        (chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "invalid_value"),
        (chat(messages=[{"role": "user"}]), "messages[0]", "invalid_value"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages[0].content",
            "invalid_type",
        ),
        (chat(messages=[{"role": "tool", "content": "42"}]), "messages[0]", "invalid_value"),
        (
            chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]),
            "messages[0].tool_calls[0].function.arguments",
            "missing_required_parameter",
        ),
        (chat(temperature=-0.1), "temperature", "invalid_value"),
        (chat(temperature=2.5), "temperature", "invalid_value"),
        (chat(temperature="0.5"), "temperature", "invalid_type"),
        (chat(top_p=0), "top_p", "invalid_value"),
        (chat(top_p=1.5), "top_p", "invalid_value"),
        (chat(top_k=-2), "top_k", "invalid_value"),
        (chat(n=0), "n", "invalid_value"),
        (chat(n=MAX_N + 1), "n", "invalid_value"),
        (chat(n=1.5), "n", "invalid_type"),
        (chat(n=True), "n", "invalid_type"),
        (chat(max_tokens=0), "max_tokens", "invalid_value"),
        (chat(max_completion_tokens=-1), "max_completion_tokens", "invalid_value"),
        (chat(seed=2**64), "seed", "invalid_value"),
        (chat(presence_penalty=2.5), "presence_penalty", "invalid_value"),
        (chat(frequency_penalty=-3), "frequency_penalty", "invalid_value"),
        (chat(stop=5), "stop", "invalid_type"),
        (chat(stop=[""]), "stop", "invalid_value"),
        (chat(stop=["s"] * 17), "stop", "invalid_value"),
        (chat(stop_token_ids=[-1]), "stop_token_ids[0]", "invalid_value"),
        (chat(stream="yes"), "stream", "invalid_type"),
        (chat(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
        (
            chat(stream=True, stream_options={"include_usage": 1}),
            "stream_options.include_usage",
            "invalid_type",
        ),
        (chat(logprobs=1), "logprobs", "invalid_type"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
        (chat(top_logprobs=2), "top_logprobs", "invalid_value"),
        (chat(tool_choice="required"), "tool_choice", "unsupported_value"),
        (
            chat(tool_choice={"type": "function", "function": {"name": "f"}}),
            "tool_choice",
            "unsupported_value",
        ),
        (chat(tool_choice="sometimes"), "tool_choice", "invalid_value"),
        (chat(tools=[{"type": "function"}]), "tools[0].function", "missing_required_parameter"),
        (
            chat(chat_template_kwargs={"add_generation_prompt": False}),
            "chat_template_kwargs",
            "invalid_value",
        ),
        (chat(chat_template_kwargs=[1]), "chat_template_kwargs", "invalid_type"),
    ],
)
def test_bad_chat_request(body: bytes, param: str | None, code: str | None) -> None:
    error = error_of(ChatCompletionRequest, body)
    assert (error.param, error.code) == (param, code), error.message
    assert error.message


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (completion(prompt=[]), "prompt", "empty_array"),
        (completion(prompt=[[]]), "prompt", "invalid_type"),
        (completion(prompt=[1, "a"]), "prompt", "invalid_type"),
        (completion(prompt=[-1]), "prompt", "invalid_type"),
        (completion(prompt=[[1], [True]]), "prompt", "invalid_type"),
        (completion(prompt=3), "prompt", "invalid_type"),
        (completion(prompt=["a"] * 65), "prompt", "invalid_value"),
        (json.dumps({"model": "m"}).encode(), "prompt", "missing_required_parameter"),
        (completion(echo=True), "echo", "unsupported_value"),
        (completion(logprobs=True), "logprobs", "invalid_type"),
        (completion(logprobs=21), "logprobs", "invalid_value"),
        (completion(max_tokens=0), "max_tokens", "invalid_value"),
        (completion(temperature=-1), "temperature", "invalid_value"),
    ],
)
def test_bad_completion_request(body: bytes, param: str, code: str) -> None:
    error = error_of(CompletionRequest, body)
    assert (error.param, error.code) == (param, code), error.message


def test_non_finite_numbers_are_rejected() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    assert error_of(ChatCompletionRequest, body).param == "temperature"
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 1e999}'
    assert error_of(ChatCompletionRequest, body).param == "top_p"


def test_context_messages_are_worded_like_openai() -> None:
    error = error_of(ChatCompletionRequest, chat(messages=[]))
    assert error.message == (
        "Invalid 'messages': empty array. Expected an array with minimum length 1, "
        "but got an empty array instead."
    )
    assert error_of(ChatCompletionRequest, chat(temperature=-1)).message.startswith(
        "Invalid value for 'temperature'"
    )
    assert error_of(ChatCompletionRequest, b"{").message.startswith("Invalid JSON body")


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        ("", [""]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (list(range(500)), [list(range(500))]),  # one long token-id prompt is not a batch of 500
    ],
)
def test_prompt_shapes_normalise_to_a_batch(prompt: Any, expected: list[Any]) -> None:
    assert parse_request(CompletionRequest, completion(prompt=prompt)).prompt == expected


def test_batches_above_the_limit_are_refused() -> None:
    error = error_of(CompletionRequest, completion(prompt=["x"] * 65))
    assert error.status == 400 and "at most 64 prompts" in error.message


def test_defaults_nulls_and_unknown_fields() -> None:
    request = parse_request(
        ChatCompletionRequest,
        chat(temperature=None, n=None, stop=None, store=True, metadata={"a": "b"}, service_tier="auto"),
    )
    assert request.temperature is None and request.top_p is None and request.top_k is None
    assert request.n == 1 and request.stop == [] and not request.stream and not request.include_usage
    assert request.requested_max_tokens is None and request.num_logprobs is None
    completion_request = parse_request(CompletionRequest, completion())
    assert completion_request.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert completion_request.logprobs is None


def test_sampling_fields_are_kept() -> None:
    request = parse_request(
        ChatCompletionRequest,
        chat(
            temperature=0,
            top_p=0.5,
            top_k=-1,
            n=3,
            seed=-5,
            stop="###",
            stop_token_ids=[7],
            max_tokens=9,
            max_completion_tokens=5,
            logprobs=True,
            top_logprobs=4,
            stream=True,
            stream_options={"include_usage": True},
            ignore_eos=True,
            skip_special_tokens=False,
        ),
    )
    assert (request.temperature, request.top_p, request.top_k, request.n, request.seed) == (0, 0.5, -1, 3, -5)
    assert request.stop == ["###"] and request.stop_token_ids == [7]
    assert request.requested_max_tokens == 5  # max_completion_tokens supersedes max_tokens
    assert request.num_logprobs == 4 and request.include_usage
    assert request.ignore_eos and not request.skip_special_tokens
    assert parse_request(ChatCompletionRequest, chat(logprobs=True)).num_logprobs == 0


def test_template_inputs_keep_openai_messages_for_the_tokenizer() -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = parse_request(
        ChatCompletionRequest,
        chat(messages=messages, tools=tools, chat_template_kwargs={"enable_thinking": False}),
    )
    rendered, rendered_tools, kwargs = request.template_inputs()
    assert rendered == [
        {"role": "developer", "content": "a\nb"},
        {"role": "user", "content": "q", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert rendered_tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert kwargs == {"enable_thinking": False}


def test_tokenize_requests() -> None:
    assert parse_request(TokenizeRequest, b'{"prompt": "hi"}').prompt == "hi"
    assert parse_request(TokenizeRequest, json.dumps({"messages": USER}).encode()).messages is not None
    assert error_of(TokenizeRequest, b"{}").param == "prompt"
    assert error_of(TokenizeRequest, json.dumps({"prompt": "a", "messages": USER}).encode()).param == "prompt"
    assert parse_request(DetokenizeRequest, b'{"tokens": [1, 2]}').tokens == [1, 2]
    assert error_of(DetokenizeRequest, b'{"tokens": [1, -2]}').param == "tokens[1]"


def test_error_objects() -> None:
    assert [error_type_for_status(s) for s in (400, 401, 403, 404, 413, 422, 429, 500, 503, 502)] == [
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "invalid_request_error",
        "invalid_request_error",
        "invalid_request_error",
        "rate_limit_error",
        "server_error",
        "service_unavailable",
        "server_error",
    ]
    error = model_not_found("gpt-x")
    assert error.status == 404
    assert error.to_dict() == {
        "error": {
            "message": "The model `gpt-x` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    response = APIError("slow down", 429).to_response()
    assert response.status_code == 429
    assert json.loads(response.body)["error"]["type"] == "rate_limit_error"
