"""Feature precompute through infer/: parity with transformers, manifest, resumability, torchrun, dataset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from data_tools import precompute
from data_tools.config import compose
from data_tools.features import EpochSampler, FeatureDataset
from data_tools.shards import MANIFEST, sha256_file, temp_path
from infer.cli import run_cli
from infer.models.common import final_logits
from mtp_train.target import load_target

ROOT = Path(__file__).resolve().parents[1]
AUX_LAYERS = [1, 3]
NUM_RECORDS, PER_SHARD = 24, 8


def overrides(assets_dir: Path, out_dir: Path, **extra) -> list[str]:
    """A small fp32 job: 24 ShareGPT records (mixed lengths), 3 shards, two aux layers."""
    values = {
        "model.path": str(assets_dir / "stories260K" / "hf-reference"),
        "output_dir": str(out_dir),
        "data.paths": f"[{assets_dir / 'eval' / 'fastchat_dummy_conversation.json'}]",
        "data.limit": NUM_RECORDS,
        "precompute.records_per_shard": PER_SHARD,
        "precompute.dtype": "float32",
        "precompute.aux_layers": f"[{','.join(map(str, AUX_LAYERS))}]",
        "precompute.max_tokens_per_batch": 1024,
        "precompute.progress": "false",
    }
    values.update(extra)
    return [f"{key}={value}" for key, value in values.items()]


Baseline = namedtuple("Baseline", "dir manifest")


@pytest.fixture(scope="module")
def baseline(assets_dir: Path, tmp_path_factory) -> Baseline:
    """An uninterrupted single-process run, in this process."""
    out_dir = tmp_path_factory.mktemp("baseline")
    manifest = precompute.run(compose("precompute", overrides(assets_dir, out_dir)))
    return Baseline(out_dir, manifest)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def subprocess_env() -> dict[str, str]:
    # Same thread count as this process (torchrun would otherwise pick 1): identical float reductions, equal bytes.
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": str(ROOT)}


def test_hidden_states_equal_transformers(baseline: Baseline, stories_reference, stories_hf_dir: Path) -> None:
    dataset = FeatureDataset(baseline.dir, aux_layers=AUX_LAYERS)
    target = load_target(OmegaConf.create({"name": "stories260k", "path": str(stories_hf_dir)}), torch.float32)
    head = lambda hidden: final_logits(target.shared.final_norm, target.shared.lm_head, hidden)  # noqa: E731
    layers = stories_reference.model.layers
    captured = {}
    hook = layers[-1].register_forward_hook(lambda m, args, out: captured.update(last=out[0] if isinstance(out, tuple) else out))
    try:
        for index in range(0, len(dataset), 3):  # records of 8 shards' worth of lengths, from every shard
            item = dataset[index]
            with torch.no_grad():
                ref = stories_reference(item["input_ids"][None], output_hidden_states=True)
            hidden = item["hidden_states"]
            assert hidden.dtype == torch.float32 and hidden.shape == (len(item["input_ids"]), 64)
            # transformers' hidden_states[i + 1] is decoder layer i's output; its last entry is after the final norm.
            torch.testing.assert_close(hidden, captured["last"][0], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(stories_reference.model.norm(hidden), ref.hidden_states[-1][0], atol=2e-5, rtol=1e-5)
            for k, layer in enumerate(AUX_LAYERS):
                torch.testing.assert_close(item["aux_hidden_states"][:, k], ref.hidden_states[layer + 1][0],
                                           atol=2e-5, rtol=1e-5)
            # Logits are not stored: the frozen norm + lm_head recompute them from the stored hidden states.
            torch.testing.assert_close(head(hidden), ref.logits[0], atol=1e-4, rtol=1e-5)
    finally:
        hook.remove()


def test_manifest_describes_the_shards(baseline: Baseline, assets_dir: Path) -> None:
    manifest = json.loads((baseline.dir / MANIFEST).read_text())
    assert manifest == baseline.manifest
    assert manifest["num_records"] == NUM_RECORDS and len(manifest["shards"]) == NUM_RECORDS // PER_SHARD
    assert manifest["model"]["weights_sha256"]["model.safetensors"].startswith("407a7c581bdd")
    assert set(manifest["tokenizer"]["files_sha256"]) >= {"tokenizer.json", "tokenizer_config.json"}
    sample = assets_dir / "eval" / "fastchat_dummy_conversation.json"
    sources = [s for shard in manifest["shards"] for s in shard["sources"]]
    assert sources == [f"{sample}[{i}]" for i in range(NUM_RECORDS)]
    tokens = 0
    for shard in manifest["shards"]:
        path = baseline.dir / shard["file"]
        assert sha256_file(path) == shard["sha256"] and path.stat().st_size == shard["bytes"]
        with safe_open(str(path), framework="pt") as f:
            offsets, mask = f.get_tensor("record_offsets"), f.get_tensor("loss_mask")
            assert offsets[-1] == shard["num_tokens"] and int(mask.sum()) == shard["num_loss_tokens"]
            assert f.get_slice("hidden_states").get_shape() == [shard["num_tokens"], 64]
            assert set(f.keys()) == {"input_ids", "loss_mask", "hidden_states", "record_offsets",
                                     "aux_hidden_states.1", "aux_hidden_states.3"}
        tokens += shard["num_tokens"]
    assert manifest["num_tokens"] == tokens
    minimum = 64 * 4 * 3 + 4 + 1
    assert manifest["bytes_per_token"]["minimum"] == minimum
    assert minimum < manifest["bytes_per_token"]["stored"] < minimum * 1.05


def test_dataset_reads_records_and_sampler_is_deterministic(baseline: Baseline, stories_tokenizer, assets_dir) -> None:
    dataset = FeatureDataset(baseline.dir)
    assert len(dataset) == NUM_RECORDS
    item = dataset[9]
    assert item["source"].endswith("[9]") and item["input_ids"][0] == 1 and item["loss_mask"].dtype == torch.bool
    assert stories_tokenizer.decode(item["input_ids"][item["loss_mask"]]).strip()  # assistant tokens present
    assert "aux_hidden_states" not in item
    with pytest.raises(ValueError, match="not precomputed"):
        FeatureDataset(baseline.dir, aux_layers=[2])

    def order(rank: int, world: int, epoch: int, seed: int = 0) -> list[int]:
        sampler = EpochSampler(len(dataset), seed=seed, rank=rank, world_size=world)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(0, 1, 0) == order(0, 1, 0) and sorted(order(0, 1, 0)) == list(range(NUM_RECORDS))
    assert order(0, 1, 0) != order(0, 1, 1) and order(0, 1, 0, seed=0) != order(0, 1, 0, seed=1)
    parts = [order(r, 5, 2) for r in range(5)]
    assert all(len(p) == 5 for p in parts)  # ceil(24 / 5): one index wraps around
    assert set().union(*parts) == set(range(NUM_RECORDS))
    assert parts == [order(0, 1, 2)[r::5] + ([order(0, 1, 2)[0]] if r == 4 else []) for r in range(5)]


def test_kill_then_rerun_gives_identical_bytes(baseline: Baseline, assets_dir: Path, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "tests.kill_after_shards", "1", *overrides(assets_dir, out_dir)]
    killed = subprocess.run(command, env=subprocess_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    first = out_dir / "shard-00000-of-00003.safetensors"
    assert first.is_file() and temp_path(out_dir / "shard-00001-of-00003.safetensors").is_file()
    assert not (out_dir / "shard-00001-of-00003.safetensors").exists() and not (out_dir / MANIFEST).exists()
    first_bytes = first.read_bytes()

    # The rerun (in this process: same thread count as the baseline, so the same float reductions).
    assert run_cli(lambda: precompute.main(overrides(assets_dir, out_dir))) == 0
    assert "2 of 3 shards to write" in capsys.readouterr().err  # the finished shard was skipped
    assert first.read_bytes() == first_bytes
    leftovers = folder_bytes(out_dir)
    assert not any(name.endswith(".tmp") for name in leftovers)
    assert leftovers == folder_bytes(baseline.dir)


def test_torchrun_two_processes_equal_one(baseline: Baseline, assets_dir: Path, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    out_dir = tmp_path / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "data_tools.precompute",
               *overrides(assets_dir, out_dir)]
    result = subprocess.run(command, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert folder_bytes(out_dir) == folder_bytes(baseline.dir)


def test_torchrun_tensor_parallel_equals_one_process(baseline: Baseline, assets_dir: Path, tmp_path: Path) -> None:
    """precompute.tp=2 over 2 processes (one replica of 2 ranks, each half the target): the same records, shards
    and manifest, and features within 1e-5 of their range (the sums of a row-parallel layer split in two)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    out_dir = tmp_path / "tp2"
    command = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "data_tools.precompute",
               *overrides(assets_dir, out_dir, **{"precompute.tp": 2})]
    result = subprocess.run(command, env={**subprocess_env(), "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    ours = json.loads((out_dir / MANIFEST).read_text())
    unhashed = lambda manifest: [{k: v for k, v in s.items() if k != "sha256"} for s in manifest["shards"]]  # noqa: E731
    assert unhashed(ours) == unhashed(baseline.manifest) and ours["num_tokens"] == baseline.manifest["num_tokens"]
    for shard in baseline.manifest["shards"]:
        with safe_open(str(baseline.dir / shard["file"]), framework="pt") as one, \
                safe_open(str(out_dir / shard["file"]), framework="pt") as two:
            assert one.metadata() == two.metadata() and set(one.keys()) == set(two.keys())
            for key in one.keys():
                a, b = one.get_tensor(key), two.get_tensor(key)
                if key in ("input_ids", "loss_mask", "record_offsets"):
                    assert torch.equal(a, b), key
                else:
                    rel = ((a - b).abs().max() / (a.max() - a.min())).item()
                    assert 0 < rel <= 1e-5, (shard["file"], key, rel)  # computed apart, and equal to rounding


def test_bf16_default_dry_run_and_disk_check(assets_dir: Path, tmp_path: Path, baseline: Baseline, capsys,
                                             monkeypatch) -> None:
    args = overrides(assets_dir, tmp_path / "bf16", **{"data.limit": 4, "precompute.aux_layers": "[]"})
    args = [a for a in args if not a.startswith("precompute.dtype=")]
    assert run_cli(lambda: precompute.main(["--dry-run", *args])) == 0
    err = capsys.readouterr().err
    assert "x 133 bytes/token (hidden 64 x bfloat16 x 1 + ids 4 + mask 1)" in err
    assert not (tmp_path / "bf16").exists()

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(precompute.shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 1000, 1000))
    assert run_cli(lambda: precompute.main(args)) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: the shards need ") and "precompute.force=true" in err and "Traceback" not in err
    assert run_cli(lambda: precompute.main(["--force", *args])) == 0
    monkeypatch.undo()

    bf16 = FeatureDataset(tmp_path / "bf16")[2]["hidden_states"]
    fp32 = FeatureDataset(baseline.dir)[2]["hidden_states"]
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16, fp32.bfloat16(), atol=0, rtol=0)  # round to nearest of the same values


def test_user_mistakes_are_one_line_errors(assets_dir: Path, baseline: Baseline, tmp_path: Path, capsys) -> None:
    cases = [
        (["precompute.dtype=float32"], "error: config: Missing mandatory value: output_dir"),
        (overrides(assets_dir, tmp_path / "x", **{"precompute.dtype": "int8"}), "error: precompute.dtype must be one of"),
        (overrides(assets_dir, tmp_path / "x", **{"precompute.aux_layers": "[5]"}), "error: precompute.aux_layers"),
        (overrides(assets_dir, tmp_path / "x", **{"data.paths": "[nope.jsonl]"}), "error: data file nope.jsonl does not"),
        (overrides(assets_dir, tmp_path / "x", **{"precompute.tp": 2}),
         "error: precompute.tp=2 needs a multiple of 2 processes: run it as `torchrun --nproc_per_node 2 x replicas"),
        (overrides(assets_dir, tmp_path / "x", **{"precompute.tp": 0}), "error: precompute.tp must be >= 1, got 0"),
        # A different job pointed at a finished folder must not mix its shards with the old ones.
        (overrides(assets_dir, baseline.dir, **{"precompute.aux_layers": "[]"}), "was written by a different run"),
    ]
    for args, message in cases:
        assert run_cli(lambda: precompute.main(args)) == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert message in last and last.startswith("error: ") and "Traceback" not in err, err


def test_help_of_every_command(capsys) -> None:
    from data_tools import bench_precompute, regenerate  # noqa: PLC0415

    for module in (precompute, regenerate, bench_precompute):
        with pytest.raises(SystemExit) as exit_info:
            module.main(["--help"])
        assert exit_info.value.code == 0 and "usage: python -m data_tools." in capsys.readouterr().out
