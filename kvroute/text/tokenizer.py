"""Text <-> token ids, and chat rendering, identical on the gateway and the replicas.

Built on ``tokenizers`` and ``jinja2`` only (no transformers, no torch) but matching what
``transformers`` 5 does when it loads the same files with ``PreTrainedTokenizerFast``: the same
special tokens and template variables, tokenizer.json's own post-processor (HF ignores the config's
``add_bos_token``/``add_eos_token`` when tokenizer.json exists), and no truncation or padding even
when tokenizer.json enables them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from functools import cache, cached_property
from itertools import chain
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Encoding, Tokenizer
from tokenizers.decoders import DecodeStream

from kvroute.text.chat_template import ChatTemplate, openai_to_template_messages

LONG_TEXT_CHARS = 8192
"""From this length on a text is encoded with the GIL released (``TextTokenizer.encode``, ``_encoding``)."""
PIECEWISE_TEXT_CHARS = 65536
"""From this length on (~16k tokens, whose offsets take ~1 ms to free) boundaries are found piece by
piece (``TextTokenizer._encode_piecewise``)."""

# The special-token attributes every HF tokenizer has; each is a chat-template variable when set.
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens_map(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens HF passes to every chat template (its ``special_tokens_map``), in its order.

    The seven standard names, then any other ``*_token`` key with a string value (model-specific
    tokens such as ``image_token``), then the entries of an ``extra_special_tokens`` dict.
    """
    tokens: dict[str, str] = {}
    for key in _NAMED_SPECIAL_TOKENS:
        if (content := _token_content(config.get(key))) is not None:
            tokens[key] = content
    for key, value in config.items():
        if key not in _NAMED_SPECIAL_TOKENS and key.endswith("_token") and isinstance(value, str):
            tokens[key] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            if (content := _token_content(value)) is not None:
                tokens[key] = content
    return tokens


def _extra_special_tokens(config: Mapping[str, Any]) -> list[str]:
    """The unnamed special tokens (``additional_special_tokens``, or ``extra_special_tokens`` as a list)."""
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if not isinstance(extra, list):
        return []
    return [content for value in extra if (content := _token_content(value)) is not None]


def _named_templates(chat_template: str | None, config: Mapping[str, Any]) -> dict[str, str]:
    """Template name -> text. A chat_template.jinja file is "default" and replaces a string in the
    config; a config list of ``{name, template}`` keeps its other names (e.g. "tool_use")."""
    templates: dict[str, str] = {}
    configured = config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        templates.update({entry["name"]: entry["template"] for entry in configured})
    if chat_template is not None:
        templates["default"] = chat_template
    return templates


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE spells each byte as one printable char."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + shifted)] = b
            shifted += 1
    return mapping


def _uses_byte_level(component: Any) -> bool:
    """Whether a decoder's JSON form (possibly a Sequence) contains a ByteLevel step."""
    if not isinstance(component, Mapping):
        return False
    if component.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(step) for step in component.get("decoders") or ())


def _boundary_tokens(added: Mapping[int, AddedToken], split_special: bool) -> dict[str, int]:
    """Content -> id of the added tokens the tokenizer cuts raw text at before normalizing it.

    Left out, because their context decides whether or how they match: tokens matched in the
    normalized text, tokens that strip whitespace on their left or match whole words only, and
    special tokens when ``split_special_tokens`` makes them plain text.
    """
    return {
        token.content: token_id
        for token_id, token in added.items()
        if not (token.normalized or token.lstrip or token.single_word or (token.special and split_special))
    }


class StreamDecoder:
    """Incremental detokenizer for one generated sequence.

    Wraps ``tokenizers``' DecodeStream, which holds back a token that ends inside a multi-byte
    character until the character completes, so the concatenated steps equal the full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(list(prompt_ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The text that ``token_id`` adds ("" while a character is still incomplete)."""
        return self._stream.step(self._tokenizer, token_id) or ""


class TextTokenizer:
    """A model's tokenizer and chat template(s), loaded from the files HF models ship.

    Keeps the source files (``tokenizer_json``, ``chat_template``, ``tokenizer_config``) so a
    replica can serve them and a gateway rebuild an identical tokenizer with :meth:`from_files`.

    ``vocab_size`` counts added tokens (HF's ``len(tokenizer)``); ``all_special_ids`` are the added
    tokens flagged special, i.e. what ``skip_special_tokens`` drops; ``special_tokens`` maps names
    (``eos_token``, ...) to the strings the chat template sees; ``boundary_tokens`` (content -> id)
    are the added tokens the text is cut at before anything else runs (see
    :meth:`encode_with_boundaries`).
    """

    def __init__(
        self, tokenizer_json: str, chat_template: str | None, tokenizer_config: Mapping[str, Any]
    ) -> None:
        self.tokenizer_json = tokenizer_json
        self.tokenizer_config = dict(tokenizer_config)
        named = _named_templates(chat_template, tokenizer_config)
        self._templates = {name: ChatTemplate(text) for name, text in named.items()}
        default = self._templates.get("default")
        self.chat_template: str | None = default.source if default is not None else None
        self.special_tokens = _special_tokens_map(tokenizer_config)

        self._tok = Tokenizer.from_str(tokenizer_json)
        # HF never truncates or pads unless asked, whatever tokenizer.json says.
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = bool(tokenizer_config.get("split_special_tokens", False))
        self._add_missing_special_tokens(tokenizer_config)

        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        added = self._tok.get_added_tokens_decoder()
        self._added_contents = {token_id: token.content for token_id, token in added.items()}
        self.all_special_ids = sorted(token_id for token_id, token in added.items() if token.special)
        self.boundary_tokens = _boundary_tokens(added, split_special=self._tok.encode_special_tokens)
        self._boundary_pattern = (
            re.compile("|".join(map(re.escape, sorted(self.boundary_tokens, key=len, reverse=True))))
            if self.boundary_tokens
            else None
        )
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        decoder = self._tok.decoder
        self._byte_level = decoder is not None and _uses_byte_level(json.loads(decoder.__getstate__()))
        self.fingerprint = self._compute_fingerprint()

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        """Load tokenizer.json, chat_template.jinja (if any) and tokenizer_config.json (if any).

        An ``additional_chat_templates/`` folder is not read; named templates in the config are.
        """
        root = Path(path)
        tokenizer_json = (root / "tokenizer.json").read_text(encoding="utf-8")
        template_file = root / "chat_template.jinja"
        chat_template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        config_file = root / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        return cls(tokenizer_json, chat_template, config)

    @classmethod
    def from_files(
        cls, tokenizer_json: str, chat_template: str | None, tokenizer_config: Mapping[str, Any]
    ) -> TextTokenizer:
        """Build from file contents, e.g. the ones a gateway fetched from a replica."""
        return cls(tokenizer_json, chat_template, tokenizer_config)

    def served_files(self, model: str, block_size: int, max_model_len: int | None) -> dict[str, Any]:
        """The body of ``GET /kvroute/tokenizer`` (docs/PROTOCOL.md): the source files, so a gateway
        tokenizes exactly as the server does without model files of its own (it rebuilds the
        tokenizer with :meth:`from_files` and checks the fingerprint)."""
        return {
            "model": model,
            "fingerprint": self.fingerprint,
            "block_size": block_size,
            "max_model_len": max_model_len,
            "tokenizer_json": self.tokenizer_json,
            "chat_template": self.chat_template,
            "tokenizer_config": self.tokenizer_config,
        }

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._tok.token_to_id(token)

    def _add_missing_special_tokens(self, config: Mapping[str, Any]) -> None:
        """HF makes every configured special token an added token (at a new id if the vocabulary
        lacks it), so that text containing it encodes as that one token; so must we."""
        added = {token.content for token in self._tok.get_added_tokens_decoder().values()}
        wanted = dict.fromkeys([*self.special_tokens.values(), *_extra_special_tokens(config)])
        missing = [AddedToken(token, special=True) for token in wanted if token not in added]
        if missing:
            self._tok.add_tokens(missing)

    def _compute_fingerprint(self) -> str:
        """sha256, hex, of: the tokenizer.json text (UTF-8), a NUL byte, then the UTF-8 of
        ``json.dumps({"chat_templates": {name: text}, "tokenizer_config": config minus its
        "chat_template" key}, sort_keys=True, ensure_ascii=False, separators=(",", ":"))``.

        It covers every input that changes rendering or encoding (tokenizer.json, the templates,
        special tokens and flags in the config), and is the same computed from a directory or from
        the files a replica serves.
        """
        config = {key: value for key, value in self.tokenizer_config.items() if key != "chat_template"}
        templates = {name: template.source for name, template in self._templates.items()}
        extra = json.dumps(
            {"chat_templates": templates, "tokenizer_config": config},
            sort_keys=True,
            ensure_ascii=False,
            separators=(",", ":"),
        )
        digest = hashlib.sha256(self.tokenizer_json.encode("utf-8"))
        digest.update(b"\0")
        digest.update(extra.encode("utf-8"))
        return digest.hexdigest()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, as HF's ``tokenizer.encode``. A long text goes through
        ``encode_batch_fast``, which lets go of the GIL while it works and tracks no offsets (up to
        half the time, and none of the 10-13 ms that freeing 300k tokens' offsets holds the GIL
        for); a short one through ``encode``, which wakes no worker threads to compete with the
        engine's."""
        if len(text) < LONG_TEXT_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def _encoding(self, text: str, add_special_tokens: bool) -> Encoding:
        """A long text goes through ``encode_batch``, which lets go of the GIL while it works
        (``encode`` holds it for long stretches): the event loop keeps serving meanwhile."""
        if len(text) < LONG_TEXT_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: a text of N characters is at least
        N / max_token_chars tokens, which bounds a prompt before it is tokenized."""
        return max(1, *(len(token) for token in self._tok.get_vocab(with_added_tokens=True)))

    def boundaries(self, text: str) -> list[tuple[int, int]]:
        """Where a boundary token's text occurs in ``text``: ``(char offset, token id)``, in order.

        Candidates: :meth:`encode_with_boundaries` tells at which of them the tokenizer really cut.
        """
        if self._boundary_pattern is None:
            return []
        tokens = self.boundary_tokens
        return [(match.start(), tokens[match.group()]) for match in self._boundary_pattern.finditer(text)]

    def encode_with_boundaries(
        self, text: str, candidates: Sequence[tuple[int, int]]
    ) -> tuple[list[int], list[int]]:
        """The ids of ``text`` without special tokens added (as :meth:`encode_chat` encodes its
        rendering) and, for each of :meth:`boundaries`' ``candidates``, the index of the boundary
        token starting at its offset, or -1 where the tokenizer did not cut there.

        The tokenizer cuts text at boundary tokens first and encodes the pieces between them
        independently, so the ids before such an index are the ids of any text that has the same
        characters up to that offset followed by the same token, whatever comes after it: one chat
        turn's ids serve the next turn, whose rendering repeats the history (``gateway.tokenizer_registry``).

        The tokenizer's offsets tell where each boundary token starts; a text of
        ``PIECEWISE_TEXT_CHARS`` or more is checked piece by piece instead (:meth:`_encode_piecewise`).
        """
        if candidates and len(text) >= PIECEWISE_TEXT_CHARS:
            return self._encode_piecewise(text, candidates)
        encoding = self._encoding(text, add_special_tokens=False)
        ids = encoding.ids
        indices: list[int] = []
        position = 0  # tokens before it are matched to earlier candidates
        for offset, token_id in candidates:
            index, search = -1, position
            while True:
                try:
                    found = ids.index(token_id, search)
                except ValueError:
                    break
                start = encoding.token_to_chars(found)[0]
                if start >= offset:
                    if start == offset:
                        index, position = found, found + 1
                    break
                search = found + 1
            indices.append(index)
        return ids, indices

    def _encode_piecewise(
        self, text: str, candidates: Sequence[tuple[int, int]]
    ) -> tuple[list[int], list[int]]:
        """:meth:`encode_with_boundaries` without offsets, whose freeing holds the GIL (10-13 ms for
        300k tokens, a stall of the event loop): the whole text, then the pieces between candidates
        (one after the other, not to take a second core from the event loop), are encoded without
        them. Where the pieces' ids join up to the whole's, the tokenizer cut at every candidate, and
        each candidate's index is where its piece begins, if that piece begins with its token (not,
        say, with a longer added token); where they do not, no candidate is reported."""
        cuts = [offset for offset, _ in candidates]
        pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        whole = self.encode(text, add_special_tokens=False)
        parts = [encoding.ids for encoding in self._tok.encode_batch_fast(pieces, add_special_tokens=False)]
        if list(chain.from_iterable(parts)) != whole:
            return whole, [-1] * len(candidates)
        indices: list[int] = []
        start = len(parts[0])
        for (_, token_id), part in zip(candidates, parts[1:], strict=True):
            indices.append(start if part[:1] == [token_id] else -1)
            start += len(part)
        return whole, indices

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, as HF's ``tokenizer.decode``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(
        self, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence.

        ``prompt_ids`` (a few trailing prompt tokens are enough) give decoders that strip a leading
        space, like SentencePiece's, the context to keep the first generated token's space.
        """
        return StreamDecoder(self._tok, skip_special_tokens, prompt_ids)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a token stands for (OpenAI logprobs ``bytes``); may be part of a character.

        Added tokens are their text; byte-level BPE tokens are mapped back char by char to bytes;
        SentencePiece-style tokens read ``<0xNN>`` as a byte and "▁" as a space.
        """
        if (content := self._added_contents.get(token_id)) is not None:
            return content.encode("utf-8")
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if self._byte_level:
            table = _unicode_to_byte()
            if all(char in table for char in token):
                return bytes(table[char] for char in token)
            return token.encode("utf-8")
        if match := _BYTE_FALLBACK_TOKEN.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        return token.replace("▁", " ").encode("utf-8")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render OpenAI-style messages as ``apply_chat_template(tokenize=False)`` would.

        Text-part lists are joined with "\\n" and tool-call arguments decoded from JSON first (see
        :func:`~kvroute.text.chat_template.openai_to_template_messages`). The special tokens from
        tokenizer_config.json are template variables, which ``template_kwargs`` may override. With
        tools, a template named "tool_use" is preferred, as in HF.
        """
        template = self._templates.get("tool_use") if tools is not None else None
        template = template or self._templates.get("default")
        if template is None:
            if self._templates:
                raise ValueError(
                    f"this model has chat templates {sorted(self._templates)} but no default one"
                )
            raise ValueError("this model has no chat template; use the completions API with a plain prompt")
        return template.render(
            openai_to_template_messages(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **template_kwargs},
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of :meth:`render_chat`, as ``apply_chat_template(tokenize=True)``: the template
        writes the special tokens, so none are added."""
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)
