"""Reads HF safetensors checkpoints (single file or sharded with an index) into named tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The shard list from the index when there is one, else every ``*.safetensors`` file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shards listed in {INDEX_FILE} are missing: {missing}")
    return files


def iter_tensors(model_dir: Path, dtype: torch.dtype, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields tensors one at a time, already cast, so peak memory stays near one copy of the weights."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, shard.get_tensor(name).to(device=device, dtype=dtype)
