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
final name is always complete. A shard is written tensor by tensor at its final offsets (`ShardWriter`): its
header depends on shapes alone, so no process ever holds a whole shard in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from data_tools.conversations import DataError

FORMAT = "specforge-lite-features/1"
MANIFEST = "manifest.json"
ID_BYTES, MASK_BYTES, OFFSET_BYTES = 4, 1, 8
# safetensors' names of the dtypes a shard holds, in the order its writer sorts tensors (larger dtypes first,
# then by name): safetensors' own Dtype order, so that ShardWriter's bytes equal safetensors.torch.save's.
SAFETENSORS_DTYPES = {torch.int64: "I64", torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.uint8: "U8"}
_OWN_NAME = re.compile(rf"(shard-\d{{5,}}-of-\d{{5,}}\.safetensors|{re.escape(MANIFEST)})")


def shard_name(index: int, num_shards: int) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}.safetensors"


def aux_key(layer: int) -> str:
    return f"aux_hidden_states.{layer}"


def bytes_per_token(hidden_size: int, dtype: torch.dtype, num_aux_layers: int) -> int:
    """Stored bytes per token, not counting record offsets and headers: the minimum the format allows."""
    return hidden_size * dtype.itemsize * (1 + num_aux_layers) + ID_BYTES + MASK_BYTES


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A file opened on a temporary name beside `path`; when the block ends without error it is flushed to disk
    and renamed onto `path`, so readers never see a partial file (an error leaves the temporary file, which the
    next write truncates)."""
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def is_own_file(name: str) -> bool:
    """A name precompute writes in its output folder: a shard, the manifest, or the temporary file of either."""
    return bool(_OWN_NAME.fullmatch(name[1:-4] if name.startswith(".") and name.endswith(".tmp") else name))


class ShardWriter:
    """Writes a shard into an open file tensor by tensor, rows at a time, each at its final offset.

    The header (safetensors' layout: an 8-byte little-endian length, compact JSON with the metadata first, then
    the tensors sorted by dtype and name, padded with spaces to 8 bytes) follows from the shapes alone, so it is
    written first and the tensors' bytes go straight from the caller's buffers to the file: memory holds one
    batch, never the shard. The bytes equal safetensors.torch.save's for the same tensors and metadata; one
    metadata key keeps the header's byte order fixed, so equal inputs give equal bytes.
    """

    def __init__(self, f: BinaryIO, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]], meta: dict) -> None:
        order = sorted(shapes, key=lambda name: (list(SAFETENSORS_DTYPES).index(shapes[name][0]), name))
        header: dict = {"__metadata__": {"json": json.dumps(meta, sort_keys=True)}}
        self.offsets, self.row_bytes, end = {}, {}, 0
        for name in order:
            dtype, shape = shapes[name]
            row_bytes = dtype.itemsize * torch.Size(shape[1:]).numel()
            nbytes = row_bytes * shape[0]
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [end, end + nbytes]}
            self.offsets[name], self.row_bytes[name] = end, row_bytes
            end += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.f, self.data_start = f, 8 + len(text)
        f.seek(0)
        f.write(len(text).to_bytes(8, "little") + text)

    def write(self, name: str, first_row: int, rows: torch.Tensor) -> None:
        """Rows [first_row, first_row + len(rows)) of tensor `name` (already in its stored dtype, on CPU)."""
        self.f.seek(self.data_start + self.offsets[name] + first_row * self.row_bytes[name])
        self.f.write(rows.contiguous().reshape(-1).view(torch.uint8).numpy())


def read_shard_meta(path: Path) -> dict | None:
    """The shard's metadata, or None when the file is not a readable shard."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("json", "null"))
    except (OSError, RuntimeError, ValueError, SafetensorError):
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
        raise DataError(f"{path} does not exist: run `python -m data_tools.precompute` first (or it was interrupted)")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path} is not JSON ({err}): damaged, or not written by data_tools.precompute") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{path}: format {found!r}, expected {FORMAT!r}")
    return manifest


def shard_problem(root: Path, entry: dict, full_hash: bool) -> str | None:
    """What keeps shard `entry` of root's manifest from being read as precompute wrote it, as a one-line message
    that names the file, the manifest and the fix; None when nothing. Presence, size and header are cheap and
    always checked; the full sha256 (the cost: it reads every byte) only when `full_hash`."""
    path, manifest = root / entry["file"], root / MANIFEST
    rerun = (f"rerun `python -m data_tools.precompute output_dir={root}` with the overrides of the run that wrote it "
             f"(the manifest records its model, data and settings): it recomputes only missing shards")
    if not path.is_file():
        return f"{path} is missing ({manifest} lists it): {rerun}"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return (f"{path} has {size} bytes but {manifest} lists {entry['bytes']} (truncated or replaced): "
                f"delete it and {rerun}")
    if read_shard_meta(path) is None:
        return f"{path} has a damaged header (not a readable safetensors shard): delete it and {rerun}"
    if full_hash and (digest := sha256_file(path)) != entry["sha256"]:
        return (f"{path} has sha256 {digest[:16]}... but {manifest} lists {entry['sha256'][:16]}... (damaged after it "
                f"was written): delete it and {rerun}")
    return None
