"""Refusing a prompt that must exceed the model's window before spending any time on it.

Tokenizing is the costly step (about a microsecond a character here, holding the GIL for much
of it), and an 8 MiB body can hold millions of characters. A token stands for at most
``max_token_chars`` characters, and every message renders to at least one token, so a prompt of
C characters and M messages is at least ``max(M, C / max_token_chars)`` tokens: above the
window, it is refused at once with OpenAI's ``context_length_exceeded``, as it would be after
tokenizing. Only characters the chat template always copies count (system, user and tool
messages: a template may drop parts of earlier assistant turns).
"""

from __future__ import annotations

from kvroute.openai_api.errors import APIError
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest
from kvroute.text.tokenizer import TextTokenizer


def verbatim_chars(request: ChatCompletionRequest) -> int:
    """Characters of the messages every template renders verbatim."""
    return sum(len(m.content) for m in request.messages if m.content and m.role != "assistant")


def refuse_surely_too_long(
    request: ChatCompletionRequest | CompletionRequest,
    tokenizer: TextTokenizer,
    window: int | None,
    max_prompt_chars: int | None = None,
) -> None:
    """Raises the 400 a prompt would get after tokenizing, when its size alone proves it (or when
    it is over ``max_prompt_chars``, a server's own limit). ``window`` None: no window known."""
    if isinstance(request, ChatCompletionRequest):
        noun, pieces = "messages", [(verbatim_chars(request), len(request.messages))]
    else:
        noun = "prompt"
        pieces = [(len(p), 1) if isinstance(p, str) else (0, len(p)) for p in request.prompt]
    for chars, at_least in pieces:
        if max_prompt_chars is not None and chars > max_prompt_chars:
            raise APIError(
                f"Your {noun} has {chars} characters; this server accepts at most {max_prompt_chars}.",
                param=noun,
                code="context_length_exceeded",
            )
        tokens = max(at_least, -(-chars // tokenizer.max_token_chars))  # each token covers at most that
        if window is not None and tokens > window:
            raise APIError(
                f"This model's maximum context length is {window} tokens. However, your {noun} "
                f"would be at least {tokens} tokens. Please reduce the length of the {noun}.",
                param=noun,
                code="context_length_exceeded",
            )
