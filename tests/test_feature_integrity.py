"""Feature shards checked against their manifest before training reads them; precompute keeps to its own files and
writes a shard without holding it in memory (issue 10: nothing lost, nothing unpickled, every bad file named)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from data_tools import precompute, shards
from data_tools.config import compose
from data_tools.conversations import DataError
from data_tools.features import FeatureDataset, verify_shards
from data_tools.shards import MANIFEST, ShardWriter, read_manifest
from infer.cli import run_cli
from mtp_train.data import FeatureError, open_features
from tests.test_data_precompute import overrides

ROOT = Path(__file__).resolve().parents[1]
SHARD = "shard-00001-of-00003.safetensors"  # the one each case damages


@pytest.fixture(scope="module")
def features(assets_dir: Path, tmp_path_factory) -> Path:
    """6 records in 3 shards of 2, fp32, aux layers 1 and 3, precomputed in this process."""
    out = tmp_path_factory.mktemp("features")
    precompute.run(compose("precompute", overrides(assets_dir, out, **{"data.limit": 6,
                                                                           "precompute.records_per_shard": 2})))
    return out


def flip(path: Path) -> None:
    """64 bytes inverted in the middle of the hidden states: size and header intact."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def damage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"#" * 32  # the header's JSON, same size
    path.write_bytes(bytes(data))


DAMAGES = {
    "flipped": (flip, "has sha256"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "(truncated or replaced)"),
    "missing": (Path.unlink, "is missing"),
    "header": (damage_header, "has a damaged header"),
}


def damaged_copy(features: Path, folder: Path, damage: str) -> Path:
    shutil.copytree(features, folder)
    DAMAGES[damage][0](folder / SHARD)
    return folder


def assert_names_the_shard(message: str, folder: Path, damage: str) -> None:
    assert "\n" not in message and DAMAGES[damage][1] in message, message
    assert str(folder / SHARD) in message and "python -m data_tools.precompute output_dir=" in message, message
    if damage in ("flipped", "truncated", "missing"):
        assert str(folder / MANIFEST) in message, message


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_shard_is_refused_through_the_api(features: Path, tmp_path: Path, damage: str) -> None:
    folder = damaged_copy(features, tmp_path / damage, damage)
    with pytest.raises(FeatureError) as err:
        open_features(folder, 64)
    assert_names_the_shard(str(err.value), folder, damage)
    with pytest.raises(DataError) as err:  # the data side's own reader, the same check
        FeatureDataset(folder)
    assert_names_the_shard(str(err.value), folder, damage)


def test_damaged_shards_are_one_line_errors_through_the_training_cli(features: Path, tmp_path: Path,
                                                                     stories_hf_dir: Path) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    runs = {}
    for damage in sorted(DAMAGES):  # all at once: each spends its few seconds importing DeepSpeed
        folder = damaged_copy(features, tmp_path / damage, damage)
        command = [sys.executable, "-m", "mtp_train.train", f"features_dir={folder}", f"output_dir={tmp_path / f'out-{damage}'}",
                   f"model.path={stories_hf_dir}", "trainer.progress=false"]
        runs[damage] = (folder, subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True))
    for damage, (folder, process) in runs.items():
        _, stderr = process.communicate(timeout=240)
        assert process.returncode == 2, (damage, stderr[-3000:])
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, (damage, stderr[-3000:])
        assert stderr.startswith("error: "), stderr
        assert_names_the_shard(stderr.strip(), folder, damage)


def test_the_fix_the_error_names_works(features: Path, assets_dir: Path, tmp_path: Path, capsys) -> None:
    """Rerunning the precompute does not list the damaged shard anew; deleting it first recomputes it alone."""
    folder = damaged_copy(features, tmp_path / "fixed", "flipped")
    with pytest.raises(FeatureError, match="delete it and rerun"):
        open_features(folder, 64)
    args = overrides(assets_dir, folder, **{"data.limit": 6, "precompute.records_per_shard": 2})
    manifest = (folder / MANIFEST).read_bytes()
    assert run_cli(lambda: precompute.main(args)) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: {folder / SHARD} changed after {folder / MANIFEST} listed it"), last
    assert (folder / MANIFEST).read_bytes() == manifest
    (folder / SHARD).unlink()
    assert run_cli(lambda: precompute.main(args)) == 0
    assert "1 of 3 shards to write" in capsys.readouterr().err
    assert len(open_features(folder, 64)) == 6
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {p.name: p.read_bytes() for p in features.iterdir()}


def test_damaged_manifest_is_named(features: Path, tmp_path: Path) -> None:
    folder = tmp_path / "manifest"
    shutil.copytree(features, folder)
    (folder / MANIFEST).write_text((folder / MANIFEST).read_text()[:100])
    with pytest.raises(FeatureError, match=f"{folder / MANIFEST} is not JSON"):
        open_features(folder, 64)


def test_ranks_share_the_hashing(features: Path, tmp_path: Path, monkeypatch) -> None:
    """Each of a node's ranks hashes its part of the shards; the gathered problems reach every rank."""
    folder = tmp_path / "split"
    shutil.copytree(features, folder)
    flip(folder / "shard-00000-of-00003.safetensors")
    manifest = read_manifest(folder)
    hashed: list[str] = []
    real_sha256 = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda path: hashed.append(path.name) or real_sha256(path))
    rank0_found: list[str] = []
    verify_shards(folder, manifest, 0, 2, gather=lambda found: rank0_found.extend(found) or [])  # rank 0, alone
    assert hashed == ["shard-00000-of-00003.safetensors", "shard-00002-of-00003.safetensors"]
    assert len(rank0_found) == 1 and "shard-00000-of-00003.safetensors has sha256" in rank0_found[0]
    hashed.clear()
    with pytest.raises(DataError, match="shard-00000-of-00003.safetensors has sha256"):  # rank 1 gets rank 0's find
        verify_shards(folder, manifest, 1, 2, gather=lambda found: found + rank0_found)
    assert hashed == ["shard-00001-of-00003.safetensors"]


# --- precompute keeps to its own files ----------------------------------------------------------------
@pytest.mark.parametrize("name,content", [
    ("notes.txt", b"my notes"),
    ("shard-00000-of-00003.safetensors", save({"x": torch.zeros(2)})),  # a shard's name, not precompute's file
    (MANIFEST, b'{"format": "something else"}'),
])
def test_precompute_refuses_a_folder_with_a_file_it_did_not_write(assets_dir: Path, tmp_path: Path, capsys,
                                                                  name: str, content: bytes) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_bytes(content)
    args = overrides(assets_dir, out, **{"data.limit": 2, "precompute.overwrite": "true"})
    assert run_cli(lambda: precompute.main(args)) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(out / name) in last and "Traceback" not in err, err
    assert [p.name for p in out.iterdir()] == [name] and (out / name).read_bytes() == content


# --- a shard written without holding it -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shard_writer_bytes_equal_safetensors_save(dtype: torch.dtype) -> None:
    n = 37
    tensors = {"input_ids": torch.randint(0, 512, (n,), dtype=torch.int32),
               "loss_mask": torch.randint(0, 2, (n,), dtype=torch.uint8),
               "hidden_states": torch.randn(n, 6).to(dtype), "aux_hidden_states.1": torch.randn(n, 6).to(dtype),
               "aux_hidden_states.10": torch.randn(n, 6).to(dtype), "record_offsets": torch.tensor([0, 5, n])}
    meta = {"format": "x", "shard": 3, "sources": ['a "quoted" \\ path', "caf\u00e9\n\x01", "\u2603" * 9]}
    f = io.BytesIO()
    writer = ShardWriter(f, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, meta)
    for name, tensor in reversed(tensors.items()):  # any order, rows in pieces
        writer.write(name, 5, tensor[5:])
        writer.write(name, 0, tensor[:5])
    assert f.getvalue() == save(tensors, metadata={"json": json.dumps(meta, sort_keys=True)})


def test_precompute_peak_memory_per_shard_is_bounded() -> None:
    """Peak RSS of computing and writing a 25 MB shard (a subprocess, the model in its baseline) <= 1.3x its bytes;
    the lists + torch.cat + serialize-to-bytes writer this replaced peaked at about 3x."""
    command = [sys.executable, "-m", "data_tools.measure_precompute_memory", "--hidden", "256", "--intermediate",
               "512", "--vocab", "512", "--heads", "4", "--kv-heads", "2", "--aux-layers", "0", "1", "--dtype",
               "float32", "--records", "16", "--record-tokens", "512", "--json"]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout)
    assert figures["shard_bytes"] > 24e6
    assert figures["peak_shard_bytes"] <= 1.3 * figures["shard_bytes"], figures
