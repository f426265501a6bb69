"""Tiny random-weight HF models, built with transformers, to check the engine logit for logit.

Each model is a real ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` saved
with ``save_pretrained``, plus the files a served model ships: a small byte-level BPE tokenizer
trained here on an inline corpus, a tokenizer config, a generation config and a ChatML template.
Everything is deterministic (seeded weights, fixed training), so a test model's tokenizer
fingerprint, and therefore its block hashes, are the same on every machine.

transformers, torch and tokenizers are imported inside the functions: this module is importable
from the serving side without pulling them in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Added like Qwen3 ships them: atomic tokens that still decode as text (special=False).
QWEN3_EXTRA_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
TOKENIZER_VOCAB_SIZE = 500

# Qwen2/Qwen3's pre-tokenizer regex: digits one by one, letters with one leading symbol.
_QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Training text for the tiny tokenizer. Changing it changes every test model's fingerprint.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
Routing a request to the replica that already holds its prefix saves the cost of prefill.
Every chat turn resends the whole conversation, so the start of each prompt repeats itself.
The gateway tokenizes the prompt, hashes it block by block, and asks which replica has those blocks.
A key-value cache keeps the attention keys and values of every token the model has already seen.
When the cache is full, the least recently used pages are evicted to make room for new requests.
You are a helpful assistant. Please answer the question in one short sentence, and be precise.
Once upon a time there was a small model that could count: one, two, three, four, five, six, seven.
In 2024 the server handled 12345 requests per second on 8 machines with 64 cores and 512 GiB each.
Python, Rust and C++ are programming languages; JSON, YAML and TOML are formats for configuration.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
The weather today is sunny with a light breeze from the west; tomorrow it may rain in the evening.
Numbers like 3.14159, 2.71828 and 1.41421 appear in mathematics, physics and engineering.
Users, assistants, systems and tools take turns in a conversation that the template renders.
"""

# SmolLM2-135M-Instruct's own template (default system prompt included).
_SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# Qwen3's template: tools in the system turn, <think> blocks kept only after the last user query,
# tool results folded into user turns, and enable_thinking=False pre-filling an empty <think>.
_QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def chat_template_for(arch: str) -> str:
    """The chat template a test model of ``arch`` ships: SmolLM2's for llama, Qwen3's otherwise."""
    _check_arch(arch)
    return _SMOLLM2_CHAT_TEMPLATE if arch == "llama" else _QWEN3_CHAT_TEMPLATE


def build_tokenizer(arch: str) -> Tokenizer:
    """Train the tiny byte-level BPE tokenizer for ``arch``; same result on every call and machine.

    Special tokens get ids 0, 1, 2 (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) as in
    SmolLM2. The pre-tokenizer mirrors the real family: SmolLM2's individual digits before
    ByteLevel for llama, Qwen's split regex and NFC normalizer for qwen2/qwen3.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    _check_arch(arch)
    tokenizer = Tokenizer(models.BPE())
    if arch == "llama":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN_SPLIT_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if arch == "qwen3":
        tokenizer.add_tokens(
            [AddedToken(token, special=False, normalized=False) for token in QWEN3_EXTRA_TOKENS]
        )
    return tokenizer


def make_test_model(
    arch: str,
    out: Path,
    *,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
    num_shards: int = 1,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a tiny random ``arch`` model (2 layers, hidden 64, 4 heads / 2 KV heads) to ``out``.

    ``tie_word_embeddings`` defaults to True for llama and qwen2, False for qwen3, so both lm_head
    paths are covered. ``config_overrides`` go to the transformers config (e.g. ``num_hidden_layers``
    or ``rope_theta``). ``num_shards > 1`` writes exactly that many safetensors shards plus
    ``model.safetensors.index.json``. Returns ``out``.
    """
    import torch
    import transformers

    _check_arch(arch)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(arch)
    ids = {token: tokenizer.token_to_id(token) for token in (ENDOFTEXT, IM_START, IM_END)}
    bos = ids[IM_START] if arch == "llama" else ids[ENDOFTEXT]
    settings: dict[str, Any] = {
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "rms_norm_eps": 1e-5 if arch == "llama" else 1e-6,
        "rope_theta": 100000.0 if arch == "llama" else 1000000.0,
        "tie_word_embeddings": arch != "qwen3" if tie_word_embeddings is None else tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
    }
    if rope_scaling is not None:
        settings["rope_scaling"] = rope_scaling
    settings.update(config_overrides)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_class(**settings)

    # fork_rng: seed the weights without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        _randomize_identity_params(model, config.initializer_range)
    model = model.to(getattr(torch, dtype))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=bos, eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT]
    )
    max_shard_size = _shard_size_for(model.state_dict(), num_shards)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    written = sorted(out.glob("model*.safetensors"))
    if len(written) != num_shards:
        raise RuntimeError(f"expected {num_shards} weight files in {out}, transformers wrote {len(written)}")
    for weights in written:  # transformers writes them 0600; give them the directory's read bits
        weights.chmod(out.stat().st_mode & 0o666)

    template = chat_template_for(arch)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": IM_START if arch == "llama" else None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8"
    )
    return out


def _check_arch(arch: str) -> None:
    """Fail early with the accepted names rather than deep inside a dict lookup."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def _randomize_identity_params(model: torch.nn.Module, scale: float) -> None:
    """Give biases and norm weights random values too.

    transformers initializes them to 0 and 1; a loader that dropped them, or an engine that
    ignored them, would still match transformers logit for logit. Random values make it fail.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, scale)
            elif "norm" in name:
                param.copy_(1.0 + scale * torch.randn_like(param))


def _shard_size_for(state_dict: dict[str, torch.Tensor], num_shards: int) -> int:
    """The smallest ``max_shard_size`` (bytes) for which save_pretrained writes ``num_shards`` files.

    save_pretrained splits with huggingface_hub's greedy in-order packing, whose shard count only
    falls as the size grows, so a binary search over the size finds it.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    def count(size: int) -> int:
        return len(split_torch_state_dict_into_shards(state_dict, max_shard_size=size).filename_to_tensors)

    low, high = 1, sum(t.numel() * t.element_size() for t in state_dict.values())
    while low < high:
        middle = (low + high) // 2
        if count(middle) <= num_shards:
            high = middle
        else:
            low = middle + 1
    if count(low) != num_shards:
        raise ValueError(f"cannot split this model into exactly {num_shards} shards")
    return low
