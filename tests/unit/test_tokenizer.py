"""kvroute.text.tokenizer and kvroute.text.chat_template against transformers, the reference they must match.

Every parity test loads the same model directory with ``PreTrainedTokenizerFast.from_pretrained``
and requires identical rendered text and token ids. The tokenizer is a small byte-level BPE
trained here, with the ChatML special tokens and Qwen-style added tokens.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from kvroute.text.chat_template import ChatTemplate, ChatTemplateError
from kvroute.text.tokenizer import TextTokenizer

TEMPLATES = Path(__file__).parents[1] / "templates"
SMOLLM2_TEMPLATE = (TEMPLATES / "smollm2.jinja").read_text(encoding="utf-8")
QWEN3_TEMPLATE = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special, as in Qwen3: they survive decode(skip_special_tokens=True).
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the weather like in Paris today?",
    "You are a helpful assistant. Answer briefly and think step by step before answering.",
    "user assistant system tool function arguments name description parameters properties",
    '{"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}',
    "Bonjour, ça va ? Très bien, merci. Grüße aus München. héllo wörld",
    "世界你好，今天天气很好。日本語のテキストも少し。",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
]
CONFIG = {
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "clean_up_tokenization_spaces": False,
    "model_max_length": 32768,
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city — in °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}

SYSTEM_USER = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the weather like in Paris?"},
]
USER_ONLY = [{"role": "user", "content": "héllo 世界 🙂, think step by step."}]
MULTI_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Tell me a joke about <|im_end|> tokens."},
]
TEXT_PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {
        "role": "user",
        "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second."}],
    },
]
TOOL_ROUND_TRIP = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location":"Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location": "東京", "unit": "celsius"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C, cloudy"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "22°C, sunny"}]},
    {"role": "assistant", "content": "<think>\nBoth fetched.\n</think>\n\nParis 18°C, Tokyo 22°C."},
    {"role": "user", "content": "And tomorrow?"},
]
REASONING_HISTORY = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Adding two and two."},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "reasoning": "Adding three and three."},
]


def train_tokenizer_json() -> str:
    """A byte-level BPE small enough that multi-byte characters split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_tokens([AddedToken(token, special=False, normalized=False) for token in ADDED_TOKENS])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


@pytest.fixture(scope="session")
def tokenizer_json() -> str:
    return train_tokenizer_json()


ModelDir = Callable[..., Path]


@pytest.fixture
def model_dir(tmp_path: Path, tokenizer_json: str) -> ModelDir:
    """Writes a model's tokenizer files; ``placement`` says where the template goes."""
    counter = iter(range(1_000))

    def make(template: str | list[dict[str, str]] | None, placement: str = "jinja", **config: Any) -> Path:
        root = tmp_path / f"model{next(counter)}"
        root.mkdir()
        (root / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        full_config = {**CONFIG, **config}
        if placement == "jinja" and isinstance(template, str):
            (root / "chat_template.jinja").write_text(template, encoding="utf-8")
        elif template is not None:
            full_config["chat_template"] = template
        (root / "tokenizer_config.json").write_text(json.dumps(full_config), encoding="utf-8")
        return root

    return make


def load_both(root: Path) -> tuple[TextTokenizer, PreTrainedTokenizerFast]:
    return TextTokenizer.from_dir(root), PreTrainedTokenizerFast.from_pretrained(root)


def hf_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The OpenAI -> template mapping, written independently: text parts joined, arguments decoded."""
    out = []
    for message in copy.deepcopy(messages):
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(part["text"] for part in message["content"])
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(message)
    return out


def assert_parity(
    ours: TextTokenizer,
    hf: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    expected_text = hf.apply_chat_template(
        hf_form(messages), tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    expected_ids = hf.apply_chat_template(
        hf_form(messages),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    before = copy.deepcopy(messages)
    assert ours.render_chat(messages, tools, add_generation_prompt, **kwargs) == expected_text
    assert ours.encode_chat(messages, tools, add_generation_prompt, **kwargs) == expected_ids
    assert messages == before, "rendering must not modify the caller's messages"
    return expected_text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(
    "messages",
    [SYSTEM_USER, USER_ONLY, MULTI_TURN, TEXT_PARTS],
    ids=["system", "no-system", "multi", "parts"],
)
def test_smollm2_parity(
    model_dir: ModelDir, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ours, hf = load_both(model_dir(SMOLLM2_TEMPLATE, bos_token="<|im_start|>"))
    text = assert_parity(ours, hf, messages, add_generation_prompt=add_generation_prompt)
    if messages is USER_ONLY:
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize(
    ("messages", "tools"),
    [
        (SYSTEM_USER, None),
        (USER_ONLY, None),
        (MULTI_TURN, None),
        (TEXT_PARTS, None),
        (SYSTEM_USER, [WEATHER_TOOL]),
        (USER_ONLY, [WEATHER_TOOL]),
        (TOOL_ROUND_TRIP, [WEATHER_TOOL]),
        (REASONING_HISTORY, None),
    ],
    ids=["system", "no-system", "multi", "parts", "tools", "tools-no-system", "tool-calls", "reasoning"],
)
def test_qwen3_parity(
    model_dir: ModelDir,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    enable_thinking: bool | None,
    add_generation_prompt: bool,
) -> None:
    ours, hf = load_both(model_dir(QWEN3_TEMPLATE))
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = assert_parity(ours, hf, messages, tools, add_generation_prompt, **kwargs)
    if add_generation_prompt:
        assert text.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)
    if tools:
        assert '"description": "Current weather for a city — in °C."' in text  # tojson keeps non-ASCII
    if messages is TOOL_ROUND_TRIP:
        assert (
            '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>' in text
        )
        assert "<tool_response>\n22°C, sunny\n</tool_response>" in text


def test_template_environment_matches_hf(model_dir: ModelDir) -> None:
    """The globals, filters and extensions HF gives templates, and the special-token variables."""
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ image_token }}|{{ documents is none }}|"
        "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}|"
        "{{ {'b': 1, 'a': '<&>'} | tojson(separators=(',', ':')) }}|{{ strftime_now('%Y') }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ dict(x=1) }}|"
        "{% generation %}{{ messages[-1].content }}{% endgeneration %}|{{ messages[1].thinking }}"
    )
    root = model_dir(template, bos_token={"__type": "AddedToken", "content": "<s>"}, image_token="<image>")
    ours, hf = load_both(root)
    messages = [
        {"role": "user", "content": "héllo <b>", "name": None},
        {"role": "assistant", "content": "ok", "reasoning_content": "hmm"},
    ]
    assert_parity(ours, hf, messages)
    assert ours.special_tokens["image_token"] == "<image>"


def test_raise_exception_surfaces_as_chat_template_error(model_dir: ModelDir) -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('Start with a user') }}{% endif %}"
    tok = TextTokenizer.from_dir(model_dir(template))
    with pytest.raises(ChatTemplateError, match=r"^Start with a user$"):
        tok.render_chat([{"role": "assistant", "content": "hi"}])
    assert isinstance(ChatTemplateError("x"), ValueError)


def test_template_failures_are_chat_template_errors(model_dir: ModelDir) -> None:
    """SmolLM2 concatenates content, so an assistant turn without content cannot render."""
    tok = TextTokenizer.from_dir(model_dir(SMOLLM2_TEMPLATE))
    with pytest.raises(ChatTemplateError):
        tok.render_chat(TOOL_ROUND_TRIP)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "empty conversation"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "only text parts",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            "valid JSON",
        ),
    ],
)
def test_invalid_messages(model_dir: ModelDir, messages: list[dict[str, Any]], match: str) -> None:
    tok = TextTokenizer.from_dir(model_dir(QWEN3_TEMPLATE))
    with pytest.raises(ValueError, match=match):
        tok.render_chat(messages)


def test_no_chat_template(model_dir: ModelDir) -> None:
    ours, hf = load_both(model_dir(None))
    assert ours.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        ours.render_chat(SYSTEM_USER)
    with pytest.raises(ValueError):
        hf.apply_chat_template(SYSTEM_USER)
    assert ours.encode("plain prompt") == hf.encode("plain prompt")


@pytest.mark.parametrize("placement", ["jinja", "config"])
def test_template_placement(model_dir: ModelDir, placement: str) -> None:
    ours, hf = load_both(model_dir(QWEN3_TEMPLATE, placement=placement))
    assert ours.chat_template == QWEN3_TEMPLATE
    assert_parity(ours, hf, SYSTEM_USER, [WEATHER_TOOL])


def test_jinja_file_overrides_config_template(model_dir: ModelDir) -> None:
    root = model_dir(SMOLLM2_TEMPLATE, placement="jinja", chat_template=QWEN3_TEMPLATE)
    ours, hf = load_both(root)
    assert ours.chat_template == SMOLLM2_TEMPLATE
    assert_parity(ours, hf, USER_ONLY)


def test_named_templates_pick_tool_use_for_tools(model_dir: ModelDir) -> None:
    named = [
        {"name": "default", "template": SMOLLM2_TEMPLATE},
        {"name": "tool_use", "template": QWEN3_TEMPLATE},
    ]
    ours, hf = load_both(model_dir(named, placement="config"))
    assert ours.chat_template == SMOLLM2_TEMPLATE
    assert "SmolLM" in assert_parity(ours, hf, USER_ONLY)
    assert "# Tools" in assert_parity(ours, hf, USER_ONLY, [WEATHER_TOOL])


def test_fingerprint(model_dir: ModelDir, tokenizer_json: str) -> None:
    tok = TextTokenizer.from_dir(model_dir(QWEN3_TEMPLATE))
    assert len(tok.fingerprint) == 64 and int(tok.fingerprint, 16) >= 0
    served = json.loads(json.dumps(tok.tokenizer_config))  # what a gateway gets over HTTP
    rebuilt = TextTokenizer.from_files(tok.tokenizer_json, tok.chat_template, served)
    assert rebuilt.fingerprint == tok.fingerprint
    assert (
        TextTokenizer.from_dir(model_dir(QWEN3_TEMPLATE, placement="config")).fingerprint == tok.fingerprint
    )
    assert (
        TextTokenizer.from_files(tokenizer_json, QWEN3_TEMPLATE + " ", CONFIG).fingerprint != tok.fingerprint
    )
    assert TextTokenizer.from_files(tokenizer_json, SMOLLM2_TEMPLATE, CONFIG).fingerprint != tok.fingerprint
    assert TextTokenizer.from_files(tokenizer_json, None, CONFIG).fingerprint != tok.fingerprint


@pytest.mark.parametrize(
    "config",
    [
        {},
        # HF ignores these flags when tokenizer.json exists: its post-processor decides.
        {"add_bos_token": True, "bos_token": "<|endoftext|>"},
        {"add_eos_token": True},
        {"bos_token": "<s>"},  # missing from the vocabulary: HF adds it at a new id
    ],
    ids=["plain", "add-bos-flag", "add-eos-flag", "new-bos"],
)
def test_encode_decode_parity(model_dir: ModelDir, config: dict[str, Any]) -> None:
    ours, hf = load_both(model_dir(QWEN3_TEMPLATE, **config))
    for text in ["héllo 世界 🙂", "<s><|im_start|>user\n<think>x</think><|im_end|>", " leading  spaces\n\n"]:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == hf.encode(text, add_special_tokens=add_special_tokens)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.vocab_size == len(hf)
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.all_special_ids == sorted(hf.all_special_ids)
    assert [ours.id_to_token(i) for i in range(ours.vocab_size)] == hf.convert_ids_to_tokens(
        list(range(ours.vocab_size))
    )
    assert ours.token_to_id("<think>") == hf.convert_tokens_to_ids("<think>")


def test_special_token_ids(model_dir: ModelDir) -> None:
    tok = TextTokenizer.from_dir(model_dir(QWEN3_TEMPLATE))
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>") is not None
    assert tok.bos_token_id is None
    think = tok.token_to_id("<think>")
    assert think not in tok.all_special_ids
    assert tok.decode([think, *tok.encode("hi"), tok.eos_token_id]) == "<think>hi"


def test_decode_stream_matches_full_decode(model_dir: ModelDir) -> None:
    tok = TextTokenizer.from_dir(model_dir(QWEN3_TEMPLATE))
    text = "héllo 世界 🙂<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        stream = tok.decode_stream(skip_special_tokens=skip)
        pieces = [stream.step(token_id) for token_id in ids]
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert "" in pieces, "the emoji spans several byte tokens, which must be held back"
    prompt = tok.encode("Paris?", add_special_tokens=False)
    stream = tok.decode_stream(prompt_ids=prompt)
    assert "".join(stream.step(token_id) for token_id in ids) == tok.decode(ids)


def test_token_bytes(model_dir: ModelDir) -> None:
    tok = TextTokenizer.from_dir(model_dir(QWEN3_TEMPLATE))
    text = "héllo 世界 🙂 <think>ok</think>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(token_id) for token_id in ids) == text.encode("utf-8")
    assert any(len(tok.token_bytes(token_id).decode("utf-8", errors="ignore")) == 0 for token_id in ids)
    assert tok.token_bytes(tok.eos_token_id) == b"<|im_end|>"
    with pytest.raises(ValueError):
        tok.token_bytes(10**9)
