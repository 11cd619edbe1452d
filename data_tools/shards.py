"""The on-disk format of precomputed features: safetensors shards plus a JSON manifest, written atomically.

One shard holds a fixed run of records, their tokens concatenated:
  input_ids               [N] int32
  loss_mask               [N] uint8   1 on assistant tokens
  hidden_states           [N, hidden] the last decoder layer's output before the final norm (bf16/fp16/fp32)
  aux_hidden_states.{i}   [N, hidden] decoder layer i's output, for each chosen layer (EAGLE-3-style heads)
  record_offsets          [R + 1] int64 record r is tokens [offsets[r], offsets[r + 1])
Its safetensors metadata has one key, "json": the shard index, the records' sources and a fingerprint of
everything that determines its contents (so a rerun can tell a finished shard of the same run from a stale one).
Every file is written to a temporary name in the same folder and renamed into place: a file under its
final name is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

FORMAT = "specforge-lite-features/1"
MANIFEST = "manifest.json"
ID_BYTES, MASK_BYTES, OFFSET_BYTES = 4, 1, 8


def shard_name(index: int, num_shards: int) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}.safetensors"


def aux_key(layer: int) -> str:
    return f"aux_hidden_states.{layer}"


def bytes_per_token(hidden_size: int, dtype: torch.dtype, num_aux_layers: int) -> int:
    """Stored bytes per token, not counting record offsets and headers: the minimum the format allows."""
    return hidden_size * dtype.itemsize * (1 + num_aux_layers) + ID_BYTES + MASK_BYTES


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename: readers never see a partial file."""
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def shard_bytes(tensors: dict[str, torch.Tensor], meta: dict) -> bytes:
    """Serialize a shard; one metadata key keeps the header's byte order fixed, so equal inputs give equal bytes."""
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata={"json": json.dumps(meta, sort_keys=True)})


def read_shard_meta(path: Path) -> dict | None:
    """The shard's metadata, or None when the file is not a readable shard."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("json", "null"))
    except (OSError, RuntimeError, ValueError, json.JSONDecodeError):
        return None


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(out_dir: Path, manifest: dict) -> None:
    atomic_write_bytes(out_dir / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())


def read_manifest(out_dir: Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `python -m data_tools.precompute` first (or it was interrupted)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest
