"""Tiny test models: they load in transformers, shard on request, and tokenize deterministically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replica.tools.tiny_models import (
    ARCHS,
    IM_END,
    IM_START,
    QWEN3_EXTRA_TOKENS,
    build_tokenizer,
    make_test_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SAMPLE_TEXT = (
    "Hello, world! In 2024 we served 12345 requests.\n\tcafé, naïve, 東京 🙂 <|im_start|>x<|im_end|>"
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("test_models")
    return {arch: make_test_model(arch, root / arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_transformers_with_eager_attention(model_dirs: dict[str, Path], arch: str) -> None:
    model_dir = model_dirs[arch]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 16
    assert config["tie_word_embeddings"] is (arch != "qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == IM_END
    inputs = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.1  # random weights, but not flat

    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids([IM_END, "<|endoftext|>"])


@pytest.mark.parametrize("arch", ARCHS)
def test_biases_and_norms_are_not_identity(model_dirs: dict[str, Path], arch: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[arch])
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            assert param.abs().sum() > 0, name
        elif "norm" in name:
            assert not torch.equal(param, torch.ones_like(param)), name


def test_sharded_model_has_index_and_same_weights(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    sharded = make_test_model("qwen3", tmp_path / "sharded", num_shards=3)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert not (sharded / "model.safetensors").exists()

    whole = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"]).state_dict()
    split = transformers.AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[name], split[name]) for name in whole)


def test_dtype_seed_and_rope_scaling(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    first = make_test_model("llama", tmp_path / "a", seed=1, dtype="bfloat16", rope_scaling=scaling)
    second = make_test_model("llama", tmp_path / "b", seed=2)
    config = json.loads((first / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    rope = config.get("rope_parameters") or config["rope_scaling"]
    assert rope["rope_type"] == "llama3"
    assert rope["factor"] == 8.0
    a = transformers.AutoModelForCausalLM.from_pretrained(first, dtype="auto")
    b = transformers.AutoModelForCausalLM.from_pretrained(second)
    assert a.dtype == torch.bfloat16
    assert not torch.equal(a.model.embed_tokens.weight.float(), b.model.embed_tokens.weight)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_and_keeps_special_tokens_whole(model_dirs: dict[str, Path], arch: str) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dirs[arch] / "tokenizer.json"))
    ids = tokenizer.encode(SAMPLE_TEXT).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == SAMPLE_TEXT
    assert len(tokenizer.encode("12345").ids) == 5
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", IM_START, IM_END)] == [0, 1, 2]
    extra = QWEN3_EXTRA_TOKENS if arch == "qwen3" else ()
    for token in (IM_START, IM_END, *extra):
        assert len(tokenizer.encode(token).ids) == 1, token
    assert 500 <= tokenizer.get_vocab_size() <= 510


def test_tokenizer_files_are_deterministic(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    for arch in ARCHS:
        again = make_test_model(arch, tmp_path / arch)
        for name in TOKENIZER_FILES:
            assert (again / name).read_bytes() == (model_dirs[arch] / name).read_bytes(), (arch, name)


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    """Rust hash maps are seeded per process; training must not depend on their order."""
    script = "from replica.tools.tiny_models import build_tokenizer; print(build_tokenizer('qwen3').to_str())"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, "-c", script]
    runs = {subprocess.run(command, env=env, check=True, capture_output=True).stdout for _ in range(2)}
    assert runs == {(build_tokenizer("qwen3").to_str() + "\n").encode()}


def test_chat_templates(model_dirs: dict[str, Path]) -> None:
    smol = transformers.AutoTokenizer.from_pretrained(model_dirs["llama"])
    text = smol.apply_chat_template(CHAT[1:], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")

    qwen = transformers.AutoTokenizer.from_pretrained(model_dirs["qwen3"])
    plain = qwen.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert plain == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = qwen.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert no_think == plain + "<think>\n\n</think>\n\n"
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    with_tools = qwen.apply_chat_template(CHAT, tools=[tool], add_generation_prompt=True, tokenize=False)
    assert '"name": "get_time"' in with_tools
    assert "<tools>" in with_tools
    assert "<tool_call>" in with_tools

    for arch in ARCHS:
        config = json.loads((model_dirs[arch] / "tokenizer_config.json").read_text())
        assert config["chat_template"] == (model_dirs[arch] / "chat_template.jinja").read_text()


def test_unknown_arch_and_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        make_test_model("gpt2", tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        make_test_model("llama", tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="num_shards"):
        make_test_model("llama", tmp_path, num_shards=0)
