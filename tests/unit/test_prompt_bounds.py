"""A prompt whose size alone proves it too long is refused before it is tokenized, with the 400
it would get afterwards; one that might fit is left to the tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.openai_api.errors import APIError
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest, parse_request
from kvroute.text.bounds import refuse_surely_too_long
from kvroute.text.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(llama_dir)


def chat(*contents: str, role: str = "user") -> ChatCompletionRequest:
    messages = [{"role": role, "content": content} for content in contents]
    return parse_request(
        ChatCompletionRequest, ChatCompletionRequest(model="m", messages=messages).model_dump_json().encode()
    )


def test_a_prompt_that_must_exceed_the_window_is_refused(tokenizer: TextTokenizer) -> None:
    window = 100
    over = "x" * (window * tokenizer.max_token_chars + 1)
    with pytest.raises(APIError) as refused:
        refuse_surely_too_long(chat(over), tokenizer, window)
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "context_length_exceeded",
        "messages",
    )
    with pytest.raises(APIError):
        refuse_surely_too_long(chat(*["hi"] * (window + 1)), tokenizer, window)  # a token a message at least
    with pytest.raises(APIError):
        refuse_surely_too_long(
            CompletionRequest(model="m", prompt=[list(range(window + 1))]), tokenizer, window
        )


def test_what_might_fit_is_left_to_the_tokenizer(tokenizer: TextTokenizer) -> None:
    window = 100
    refuse_surely_too_long(chat("x" * (window * tokenizer.max_token_chars)), tokenizer, window)
    refuse_surely_too_long(chat("x" * 10**6, role="assistant"), tokenizer, window)  # templates may drop it
    refuse_surely_too_long(chat("x" * 10**6), tokenizer, None)  # no window known


def test_a_servers_own_character_limit(tokenizer: TextTokenizer) -> None:
    with pytest.raises(APIError) as refused:
        refuse_surely_too_long(
            CompletionRequest(model="m", prompt="abcdef"), tokenizer, None, max_prompt_chars=5
        )
    assert refused.value.code == "context_length_exceeded" and "at most 5" in refused.value.message


def test_the_longest_token_bounds_every_encoding(tokenizer: TextTokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 50
    assert len(text) <= len(tokenizer.encode(text)) * tokenizer.max_token_chars
