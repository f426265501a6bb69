"""Chat templates rendered exactly as ``transformers``' ``apply_chat_template`` renders them.

The gateway and the replicas must turn one chat request into the same token ids, or prefix hashes
never match; both render through this module. It mirrors ``transformers.utils.chat_template_utils``
(the sandboxed jinja2 environment, its globals and filters, and the message normalisation that
``apply_chat_template`` applies first) without importing transformers.

Two layers: :func:`openai_to_template_messages` maps OpenAI-API messages to the dicts HF templates
expect (what vLLM does for text-only models), and :class:`ChatTemplate` renders such dicts exactly
as HF does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; the first is the one chat templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (``raise_exception``) or failed on it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's override: jinja's own filter HTML-escapes and forces ensure_ascii, which changes tokens.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """HF's ``dict`` global: builds dicts without exposing the ``dict`` type to the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """HF's ``namespace`` global: rejects underscore attributes, which could reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's own signature trick: no named ``self``, so namespace(self=...) still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """HF's ``{% generation %}`` tag (assistant-token masks): compiles the same way, renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads this class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    """The environment ``transformers`` builds for chat templates, with the same globals and filters."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    """Compile once per distinct template text: compilation costs milliseconds, rendering microseconds."""
    try:
        return _make_environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def _normalize(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What ``apply_chat_template`` does to messages before rendering.

    Keys whose value is None are dropped (templates handle a missing key, not a None one), and a
    reasoning given under any of its names is copied to ``reasoning_content`` and ``thinking``.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"chat messages must be objects, got {type(message).__name__}")
        msg = {key: value for key, value in message.items() if value is not None}
        reasoning = next((msg[key] for key in _REASONING_FIELDS if key in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class ChatTemplate:
    """One compiled chat template; :meth:`render` matches ``apply_chat_template(tokenize=False)``."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` (HF-style dicts) and ``tools`` (JSON-schema dicts).

        ``template_kwargs`` are extra template variables (special tokens such as ``bos_token``,
        switches such as ``enable_thinking``); like HF, they cannot override ``messages``, ``tools``
        or ``add_generation_prompt``. HF always defines ``documents`` (None unless given), and so
        does this. Any failure inside the template raises :class:`ChatTemplateError`.
        """
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        context = {
            "documents": None,
            **template_kwargs,
            "messages": _normalize(messages),
            "tools": None if tools is None else list(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        except Exception as e:
            # The template is foreign code run on client data: any failure means a bad request.
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def _flatten_content(content: Any, role: str) -> Any:
    """Join text parts with "\\n" (vLLM's "string" content format for text-only models)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"unsupported content part in a {role!r} message: only text parts are accepted")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_tool_calls(tool_calls: Any) -> Any:
    """Decode each call's JSON ``arguments`` string to a dict, as vLLM does and HF templates expect.

    Templates write ``arguments | tojson`` for dicts, so a history re-renders in the same form the
    model produced, whatever spacing the client used.
    """
    if not isinstance(tool_calls, list):
        return tool_calls
    parsed = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            parsed.append(call)
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"tool call arguments are not valid JSON: {e}") from e
            except RecursionError:
                raise ValueError("tool call arguments are nested too deeply") from None
        elif not arguments:
            arguments = {}
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed


def openai_to_template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Map OpenAI chat messages to the plain dicts chat templates read; the input is not modified.

    ``content`` given as a list of ``{"type": "text"}`` parts becomes one string (other part types
    raise ValueError: these are text-only models), and assistant ``tool_calls`` get their
    ``arguments`` decoded from JSON.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"chat messages must be objects, got {type(message).__name__}")
        msg = dict(message)
        role = str(msg.get("role"))
        if "content" in msg:
            msg["content"] = _flatten_content(msg["content"], role)
        if "tool_calls" in msg:
            msg["tool_calls"] = _parse_tool_calls(msg["tool_calls"])
        out.append(msg)
    return out
