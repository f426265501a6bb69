"""The OpenAI request schema both the gateway and the replicas validate against (torch-free).

One rule for every bad body, so clients see what the OpenAI API itself sends:

* Every problem with the request body is HTTP **400** ``invalid_request_error``: malformed JSON,
  invalid UTF-8, a body that is not an object, a wrong type, a value out of range, a missing field
  and a semantic conflict alike (OpenAI never answers 422 here).
* ``param`` names the offending field the way OpenAI does, indices included
  (``messages[0].content``); it is null only when the body as a whole is at fault.
* ``code`` is ``missing_required_parameter``, ``invalid_type``, ``invalid_value``, ``empty_array``
  or ``unsupported_value``; null for unparseable JSON.
* ``null`` at the top level means "unset" (some SDKs send explicit nulls); unknown fields are
  ignored because SDKs send fields this server has no use for (``store``, ``metadata``, ...).
* Types are strict: ``"0.5"`` is not a number and ``1`` is not a boolean.
* What the server cannot honour is refused (``unsupported_value``), never silently ignored:
  ``echo``, and ``tool_choice`` "required" or a named function (there is no constrained decoding).

Checks that need the tokenizer (context length, token ids within the vocabulary) live with the
server that owns the tokenizer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvroute.openai_api.errors import APIError

MAX_N = 16  # choices per prompt
MAX_TOKENS_LIMIT = 2**31 - 1  # no window is larger; bigger numbers are nonsense, not requests
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_STOP = 16  # stop strings (OpenAI allows 4; vLLM any number)
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for the legacy endpoint
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})
_CUSTOM_CODES = frozenset({"invalid_type", "invalid_value", "empty_array", "unsupported_value"})

R = TypeVar("R", bound="_Model")


class _Model(BaseModel):
    """Strict, extra-tolerant base: see the module docstring for why."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    def check(self) -> None:
        """Cross-field rules, raised as :class:`APIError` so they can name their ``param``."""


class _TopLevel(_Model):
    """A whole request body: explicit top-level nulls mean the field is unset."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# --- chat messages ------------------------------------------------------------------------------


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None  # text parts are joined with newlines at validation, as the tokenizer would
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _text_content(cls, value: Any) -> str | None:
        """A string, or text parts joined with newlines (vLLM's "string" content format)."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
                return "\n".join(texts)
        raise PydanticCustomError(
            "invalid_type",
            "expected a string or an array of text parts ({'type': 'text', 'text': ...})",
        )

    @model_validator(mode="after")
    def _required_parts(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                "invalid_value", "a {role} message needs 'content'", {"role": self.role}
            )
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("invalid_value", "a tool message needs 'tool_call_id'")
        return self

    def template_message(self) -> dict[str, Any]:
        """The OpenAI form the tokenizer takes; missing content is "" (as vLLM renders it), since
        templates that concatenate ``message['content']`` fail on an undefined value."""
        rest = self.model_dump(exclude_none=True, exclude={"role", "content"})
        return {"role": self.role, "content": self.content or "", **rest}


def _non_empty_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    if not messages:
        raise PydanticCustomError(
            "empty_array",
            "empty array. Expected an array with minimum length 1, but got an empty array instead",
        )
    return messages


def _unreserved_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise PydanticCustomError("invalid_value", "may not set {keys}", {"keys": ", ".join(reserved)})
    return kwargs


Messages = Annotated[list[ChatMessage], AfterValidator(_non_empty_messages)]
TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_unreserved_kwargs)]


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def chat_template_inputs(
    messages: list[ChatMessage], tools: list[Tool] | None, kwargs: dict[str, Any] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
    """``(messages, tools, template_kwargs)`` for ``TextTokenizer.encode_chat``, as plain OpenAI dicts
    (the tokenizer maps them to what templates expect). The gateway and the replicas both render
    through here, so they produce identical token ids.
    """
    rendered = [message.template_message() for message in messages]
    rendered_tools = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    return rendered, rendered_tools, dict(kwargs or {})


# --- generation requests -----------------------------------------------------------------------


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (so far) in every chunk, with include_usage


class _GenerationRequest(_TopLevel):
    """Fields /v1/chat/completions and /v1/completions share; sampling fields left unset are None
    so the server can fall back to the model's generation_config.json."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM extension; -1 and 0 disable it
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # The prompt's token ids as a kvroute gateway computed them (kvroute.protocol.PROMPT_IDS_FIELD)
    kvroute_prompt_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str]:
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise PydanticCustomError("invalid_type", "expected a string or an array of strings")
        if len(stops) > MAX_STOP or not all(stops):
            raise PydanticCustomError(
                "invalid_value", "expected at most {max} non-empty strings", {"max": MAX_STOP}
            )
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk of the stream, not only in the last (vLLM's extension)."""
        return (
            self.include_usage
            and self.stream_options is not None
            and self.stream_options.continuous_usage_stats
        )

    @property
    def num_sequences(self) -> int:
        """Engine sequences the request makes (a batch of completions prompts makes n each)."""
        return self.n * len(getattr(self, "prompt", ())) or self.n

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
                code="invalid_value",
            )


class ChatCompletionRequest(_GenerationRequest):
    messages: Messages
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: TemplateKwargs | None = None

    @field_validator("tool_choice", mode="plain")
    @classmethod
    def _auto_or_none(cls, value: Any) -> str:
        """Only choices this server honours: it has no constrained decoding to force a tool call."""
        if value in ("auto", "none"):
            return value
        if value == "required" or isinstance(value, dict):
            raise PydanticCustomError(
                "unsupported_value",
                "'required' and named tool choices are not supported; use 'auto'",
            )
        raise PydanticCustomError("invalid_value", "expected 'auto' or 'none'")

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` supersedes the deprecated ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token for the engine (None: no logprobs at all)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_inputs(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
        return chat_template_inputs(self.messages, self.tools, self.chat_template_kwargs)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(
                "Invalid value for 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is used.",
                param="top_logprobs",
                code="invalid_value",
            )


Prompt = str | list[int]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


class CompletionRequest(_GenerationRequest):
    prompt: list[Prompt]  # normalised: one entry per prompt of the batch
    max_tokens: int = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_batch(cls, value: Any) -> list[Prompt]:
        """OpenAI's four prompt shapes: a string, strings, token ids, arrays of token ids."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            if _is_token_ids(value):
                return [value]  # one prompt of token ids: its length is the context's business
            if len(value) > MAX_PROMPTS:
                raise PydanticCustomError(
                    "invalid_value", "expected at most {max} prompts", {"max": MAX_PROMPTS}
                )
            if all(isinstance(p, str) for p in value):
                return value
            if all(_is_token_ids(p) and p for p in value):
                return value
        elif isinstance(value, list):
            raise PydanticCustomError("empty_array", "empty array")
        raise PydanticCustomError(
            "invalid_type",
            "expected a string, an array of strings, an array of token ids (integers >= 0) "
            "or an array of non-empty token-id arrays",
        )

    @property
    def num_sequences(self) -> int:
        """One engine request per prompt of the batch, each with n choices."""
        return self.n * len(self.prompt)

    def check(self) -> None:
        super().check()
        if self.kvroute_prompt_ids is not None and len(self.prompt) > 1:
            raise APIError(
                "Invalid 'kvroute_prompt_ids': it stands for a single prompt, not a batch.",
                param="kvroute_prompt_ids",
                code="invalid_value",
            )
        if self.echo:
            raise APIError("echo is not supported by this server.", param="echo", code="unsupported_value")


# --- vLLM's tokenizer endpoints ------------------------------------------------------------------


class TokenizeRequest(_TopLevel):
    """vLLM's /tokenize: exactly one of ``prompt`` (plain text) or ``messages`` (chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = None  # vLLM default: True for prompt, False for messages
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: TemplateKwargs | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(
                "Provide exactly one of 'prompt' or 'messages'.", param="prompt", code="invalid_value"
            )

    def template_inputs(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
        return chat_template_inputs(self.messages or [], self.tools, self.chat_template_kwargs)


class DetokenizeRequest(_TopLevel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# --- parsing -----------------------------------------------------------------------------------


def parse_request(cls: type[R], body: bytes) -> R:
    """Validate a raw body into ``cls``; every failure is an :class:`APIError` (400)."""
    try:
        request = cls.model_validate_json(body)
    except ValidationError as exc:
        raise _api_error(exc) from None
    request.check()
    return request


def _param(loc: tuple[int | str, ...]) -> str | None:
    """``('messages', 0, 'content')`` -> ``messages[0].content`` (OpenAI's spelling)."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None


def _api_error(exc: ValidationError) -> APIError:
    """The first validation error, worded and coded like OpenAI's."""
    error = exc.errors(include_url=False, include_input=False)[0]
    kind, param = error["type"], _param(error["loc"])
    if kind == "json_invalid":
        return APIError(f"Invalid JSON body: {error['msg'].removeprefix('Invalid JSON: ')}.")
    if param is None:
        return APIError("The request body must be a JSON object.", code="invalid_type")
    if kind == "missing":
        return APIError(
            f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    if kind in _CUSTOM_CODES:
        return APIError(f"Invalid '{param}': {error['msg']}.", param=param, code=kind)
    if kind.endswith(("_type", "_parsing")):
        return APIError(f"Invalid type for '{param}': {error['msg']}.", param=param, code="invalid_type")
    return APIError(f"Invalid value for '{param}': {error['msg']}.", param=param, code="invalid_value")
