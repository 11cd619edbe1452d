"""Precompute the target's features through the inference runtime: sharded safetensors plus a manifest.

    python -m data_tools.precompute output_dir=DIR [model=stories260k model.path=DIR] [data=sharegpt_dummy] ...
    python -m data_tools.precompute --dry-run output_dir=DIR          # the storage estimate alone
    torchrun --standalone --nproc_per_node 2 -m data_tools.precompute output_dir=DIR

Arguments after the flags are Hydra overrides of conf/precompute.yaml (its model and data groups, conf/model/
and conf/data/, are the trainer's; model.path is the target's Hugging Face folder). Steps:
  1. load and validate the conversations, tokenize them (loss mask on assistant tokens), print the counts;
  2. cut the record list into shards of records_per_shard records (fixed up front, so every rank and every
     rerun agrees on what each shard holds); rank r of W computes shards r, r + W, ...;
  3. print the storage estimate (bytes per token x tokens) and refuse to start when the disk cannot hold it;
  4. per shard: pack its records (longest first) into variable-length batches under a token budget, run
     each through `infer/` (pages from a PagePool, `build_page_metadata`, `ModelRunner.run` with the chosen
     aux layers, pages freed), and write the shard atomically; a shard already on disk from the same run is
     skipped, so a rerun after a kill finishes the job with the same bytes as an uninterrupted run;
  5. after a barrier, rank 0 writes manifest.json (shapes, dtypes, counts, sources, sha256 per shard, the
     identity of model and tokenizer), also atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import AutoTokenizer

from data_tools.config import compose
from data_tools.conversations import DataError, LoadReport, load_conversations
from data_tools.shards import (
    FORMAT, OFFSET_BYTES, atomic_write_bytes, aux_key, bytes_per_token, read_shard_meta,
    sha256_file, shard_bytes, shard_name, temp_path, write_manifest,
)
from data_tools.tokenize import PLAIN, ChatFormat, TokenizedRecord, pack_by_budget
from infer.cli import run_cli
from infer.kv_cache import PagePool, PageTable, build_page_metadata, pages_needed
from infer.loader import DTYPES, load_config, load_model, safetensors_files
from infer.model_runner import ModelRunner
from infer.models.eagle3_head import head_aux_layers
from infer.models.head_base import HeadLoadError

# Tests: after this many shards, write the next one's temp file halfway and SIGKILL the process.
CRASH_ENV = "DATA_TOOLS_CRASH_AFTER_SHARDS"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
HEADER_BYTES = 1024  # per-shard safetensors header, before the records' sources


# --- configuration ------------------------------------------------------------------------------------
def chat_format(data_cfg: DictConfig, tokenizer) -> ChatFormat:
    return ChatFormat(tokenizer, chat_template=data_cfg.chat_template, end_token=data_cfg.end_token,
                      max_length=int(data_cfg.max_length), truncate=bool(data_cfg.truncate))


def load_records(data_cfg: DictConfig, tokenizer, progress: bool) -> tuple[list[TokenizedRecord], LoadReport]:
    report = LoadReport(on_error=data_cfg.on_error)
    conversations, report = load_conversations(list(data_cfg.paths), report, split=data_cfg.split, limit=data_cfg.limit)
    records = chat_format(data_cfg, tokenizer).tokenize_all(conversations, report, progress=progress)
    if not records:
        raise DataError(f"no usable records in {', '.join(map(str, data_cfg.paths))} ({report.summary()})")
    return records, report


# --- identity and fingerprints ------------------------------------------------------------------------
def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model_identity(model_dir: Path) -> dict:
    return {
        "path": str(model_dir.resolve()),
        "config_sha256": sha256_file(model_dir / "config.json"),
        "weights_sha256": {f.name: sha256_file(f) for f in safetensors_files(model_dir)},
    }


def tokenizer_identity(model_dir: Path, data_cfg: DictConfig, tokenizer) -> dict:
    template = data_cfg.chat_template
    template_text = tokenizer.chat_template if template is None else template
    return {
        "files_sha256": {n: sha256_file(model_dir / n) for n in TOKENIZER_FILES if (model_dir / n).is_file()},
        "chat_template": template if template in (None, PLAIN) else "custom",
        "chat_template_sha256": _sha256_bytes(str(template_text).encode()),
        "end_token": data_cfg.end_token,
    }


def shard_fingerprint(settings_sha: str, records: list[TokenizedRecord]) -> str:
    """Everything that determines a shard's bytes: model, tokenizer, storage settings, and its records."""
    digest = hashlib.sha256(settings_sha.encode())
    for record in records:
        digest.update(record.source.encode() + b"\0")
        digest.update(torch.tensor(record.input_ids, dtype=torch.int32).numpy().tobytes())
        digest.update(bytes(record.loss_mask))
    return digest.hexdigest()


# --- the plan ---------------------------------------------------------------------------------------
@dataclass
class ShardPlan:
    index: int
    name: str
    records: list[TokenizedRecord]
    fingerprint: str
    done: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.records)


def plan_shards(records: list[TokenizedRecord], per_shard: int, settings_sha: str, out_dir: Path,
                overwrite: bool) -> list[ShardPlan]:
    """Fixed shards from the record list; marks the ones a previous run of the same job already finished."""
    if per_shard < 1:
        raise DataError(f"precompute.records_per_shard must be >= 1, got {per_shard}")
    num_shards = -(-len(records) // per_shard)
    plans = []
    for i in range(num_shards):
        chunk = records[i * per_shard : (i + 1) * per_shard]
        plan = ShardPlan(i, shard_name(i, num_shards), chunk, shard_fingerprint(settings_sha, chunk))
        path = out_dir / plan.name
        if path.exists():
            meta = read_shard_meta(path)
            if meta is not None and meta.get("fingerprint") == plan.fingerprint:
                plan.done = True
            elif not overwrite:
                raise DataError(
                    f"{path} was written by a different run (other data, model or settings): "
                    "choose another output_dir or set precompute.overwrite=true"
                )
        plans.append(plan)
    return plans


def storage_estimate(plans: list[ShardPlan], per_token: int) -> int:
    """Bytes the shards will take: tokens x bytes per token, plus record offsets and headers."""
    total = 0
    for plan in plans:
        sources = sum(len(r.source) + 4 for r in plan.records)
        total += plan.num_tokens * per_token + (len(plan.records) + 1) * OFFSET_BYTES + HEADER_BYTES + sources
    return total


def check_disk(needed: int, out_dir: Path, force: bool) -> int:
    """Free bytes where out_dir lives; raises when `needed` does not fit (unless forced)."""
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free and not force:
        raise DataError(
            f"the shards need {human_bytes(needed)} but {probe} has {human_bytes(free)} free: "
            "free some space, choose another output_dir, or set precompute.force=true"
        )
    return free


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


# --- running the target ------------------------------------------------------------------------------
class FeatureExtractor:
    """Runs packed, unpadded batches of records through `infer/` and gathers per-token features."""

    def __init__(self, model: torch.nn.Module, out_dtype: torch.dtype, aux_layers: list[int], max_tokens: int,
                 max_records: int, page_size: int = 16, backend: str = "auto") -> None:
        self.model = model
        self.out_dtype = out_dtype
        self.aux_layers = list(aux_layers)
        self.max_tokens, self.max_records = max_tokens, max_records
        self.page_size = page_size
        num_pages = pages_needed(max_tokens, page_size) + max_records  # each record wastes under one page
        self.pool = PagePool(num_pages, page_size)
        self.runner = ModelRunner(model, num_pages, page_size, backend)
        self.device = self.runner.device
        self.hidden_size = model.config.hidden_size

    def batches(self, lengths: list[int]) -> list[list[int]]:
        """Record indices per forward: longest first (little attention padding), packed under the budget."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        packs = pack_by_budget([lengths[i] for i in order], self.max_tokens, self.max_records)
        return [[order[j] for j in pack] for pack in packs]

    def forward(self, token_lists: list[list[int]]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One packed forward: hidden states [sum len, hidden] (and aux layers) in the model's dtype, on device."""
        lengths = [len(t) for t in token_lists]
        tables = [PageTable(self.pool) for _ in token_lists]
        try:
            for table, n in zip(tables, lengths):
                table.extend(n)
            meta = build_page_metadata([t.pages for t in tables], lengths, lengths, self.page_size, self.device)
            ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long, device=self.device)
            no_logits = torch.empty(0, dtype=torch.long, device=self.device)
            out = self.runner.run(ids, meta, no_logits, aux_layers=self.aux_layers)
        finally:
            for table in tables:
                table.free()
        return out.hidden_states, out.aux_hidden_states

    def shard_tensors(self, records: list[TokenizedRecord], bar: tqdm | None = None) -> dict[str, torch.Tensor]:
        lengths = [len(r) for r in records]
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        total = int(offsets[-1])
        hidden = torch.empty(total, self.hidden_size, dtype=self.out_dtype)
        aux = {layer: torch.empty(total, self.hidden_size, dtype=self.out_dtype) for layer in self.aux_layers}
        for batch in self.batches(lengths):
            states, aux_states = self.forward([records[i].input_ids for i in batch])
            rows = torch.cat([torch.arange(int(offsets[i]), int(offsets[i + 1])) for i in batch])
            hidden.index_copy_(0, rows, states.to(self.out_dtype).cpu())
            for layer in self.aux_layers:
                aux[layer].index_copy_(0, rows, aux_states[layer].to(self.out_dtype).cpu())
            if bar is not None:
                bar.update(int(rows.numel()))
        tensors = {
            "input_ids": torch.tensor([t for r in records for t in r.input_ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for r in records for m in r.loss_mask], dtype=torch.uint8),
            "hidden_states": hidden,
            "record_offsets": offsets,
        }
        tensors.update({aux_key(layer): aux[layer] for layer in self.aux_layers})
        return tensors


def _crash_if_asked(written: int, path: Path, data: bytes) -> None:
    """Test hook: leave a torn temp file behind and die as a killed process would."""
    crash_after = os.environ.get(CRASH_ENV)
    if crash_after is not None and written == int(crash_after):
        temp_path(path).write_bytes(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)


# --- the run ------------------------------------------------------------------------------------------
def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _validate(cfg: DictConfig, model_config) -> tuple[torch.dtype, torch.dtype, list[int]]:
    """What the schema cannot know: the aux layers against the model's depth (types and ranges: data_tools.config),
    with the layers the head asks for (an EAGLE-3 head's `head.layer_ids`) added."""
    pc, num_layers = cfg.precompute, model_config.num_hidden_layers
    aux_layers = list(pc.aux_layers)
    bad = [x for x in aux_layers if not 0 <= x < num_layers]
    if bad or len(set(aux_layers)) != len(aux_layers):
        raise DataError(f"precompute.aux_layers must be distinct layer indices in [0, {num_layers}), got {aux_layers}")
    if cfg.head.architecture == "eagle3":
        try:
            aux_layers += head_aux_layers(model_config, cfg.head.layer_ids)
        except HeadLoadError as err:
            raise DataError(str(err)) from err
    return DTYPES[pc.dtype], DTYPES[pc.model_dtype], sorted(set(aux_layers))


def run(cfg: DictConfig) -> dict | None:
    """The whole precompute; returns the manifest on rank 0 (None on other ranks and for a dry run)."""
    pc = cfg.precompute
    rank, world = _distributed()
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    progress = bool(pc.progress) and rank == 0
    model_dir, out_dir = Path(cfg.model.path), Path(cfg.output_dir)
    model_config = load_config(model_dir)
    out_dtype, model_dtype, aux_layers = _validate(cfg, model_config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    records, report = load_records(cfg.data, tokenizer, progress)
    log(report.summary())
    for line in report.details():
        log(line)

    identity = {"model": model_identity(model_dir), "tokenizer": tokenizer_identity(model_dir, cfg.data, tokenizer)}
    settings = {"format": FORMAT, **identity, "dtype": pc.dtype, "model_dtype": pc.model_dtype,
                "aux_layers": aux_layers}
    settings_sha = _sha256_bytes(json.dumps(settings, sort_keys=True).encode())
    plans = plan_shards(records, int(pc.records_per_shard), settings_sha, out_dir, bool(pc.overwrite))

    hidden = model_config.hidden_size
    per_token = bytes_per_token(hidden, out_dtype, len(aux_layers))
    tokens = sum(p.num_tokens for p in plans)
    pending = [p for p in plans if not p.done]
    needed = storage_estimate(pending, per_token)
    log(f"estimate: {tokens:,} tokens x {per_token} bytes/token (hidden {hidden} x {pc.dtype} x "
        f"{1 + len(aux_layers)} + ids {4} + mask 1) = {human_bytes(tokens * per_token)}; "
        f"{len(pending)} of {len(plans)} shards to write, {human_bytes(needed)} with offsets and headers")
    if pc.dry_run:
        return None
    free = check_disk(needed, out_dir, bool(pc.force))
    log(f"free on disk: {human_bytes(free)}")
    out_dir.mkdir(parents=True, exist_ok=True)

    mine = [p for p in pending if p.index % world == rank]
    if mine:
        device = torch.device(pc.device)
        if device.type == "cuda" and world > 1:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        model = load_model(model_dir, dtype=model_dtype, device=device)
        longest = max(len(r) for p in mine for r in p.records)
        extractor = FeatureExtractor(
            model, out_dtype, aux_layers, max(int(pc.max_tokens_per_batch), longest), int(pc.max_records_per_batch),
            int(pc.page_size), pc.attention_backend,
        )
        bar = tqdm(total=sum(p.num_tokens for p in mine), desc="precompute", unit="tok", unit_scale=True,
                   disable=not progress, dynamic_ncols=True)
        for written, plan in enumerate(mine):
            tensors = extractor.shard_tensors(plan.records, bar)
            meta = {"format": FORMAT, "shard": plan.index, "fingerprint": plan.fingerprint,
                    "sources": [r.source for r in plan.records]}
            data = shard_bytes(tensors, meta)
            path = out_dir / plan.name
            _crash_if_asked(written, path, data)
            atomic_write_bytes(path, data)
        bar.close()

    _barrier(world)
    manifest = None
    if rank == 0:
        manifest = build_manifest(cfg, plans, identity, report, hidden, per_token, aux_layers, out_dir)
        write_manifest(out_dir, manifest)
        stored = manifest["bytes_per_token"]
        log(f"wrote {len(plans)} shards, {tokens:,} tokens, {human_bytes(manifest['num_bytes'])} to {out_dir} "
            f"({stored['stored']:.1f} bytes/token on disk, minimum {stored['minimum']})")
        log(report.summary())
    _barrier(world)
    if world > 1:
        dist.destroy_process_group()
    return manifest


def build_manifest(cfg: DictConfig, plans: list[ShardPlan], identity: dict, report: LoadReport, hidden: int,
                   per_token: int, aux_layers: list[int], out_dir: Path) -> dict:
    shards = []
    for plan in plans:
        path = out_dir / plan.name
        meta = read_shard_meta(path)
        if meta is None or meta.get("fingerprint") != plan.fingerprint:
            raise DataError(f"{path} is missing or from another run after all ranks finished")
        shards.append({
            "file": plan.name, "num_records": len(plan.records), "num_tokens": plan.num_tokens,
            "num_loss_tokens": sum(sum(r.loss_mask) for r in plan.records), "bytes": path.stat().st_size,
            "sha256": sha256_file(path), "sources": [r.source for r in plan.records],
        })
    tokens = sum(s["num_tokens"] for s in shards)
    num_bytes = sum(s["bytes"] for s in shards)
    dtype = cfg.precompute.dtype
    tensors = {"input_ids": {"dtype": "int32", "shape": ["tokens"]},
               "loss_mask": {"dtype": "uint8", "shape": ["tokens"]},
               "hidden_states": {"dtype": dtype, "shape": ["tokens", hidden]},
               "record_offsets": {"dtype": "int64", "shape": ["records + 1"]}}
    tensors.update({aux_key(layer): {"dtype": dtype, "shape": ["tokens", hidden]} for layer in aux_layers})
    data_cfg = OmegaConf.to_container(cfg.data)
    return {
        "format": FORMAT, **identity, "data": data_cfg, "load_report": report.as_dict(),
        "dtype": dtype, "model_dtype": cfg.precompute.model_dtype, "hidden_size": hidden, "aux_layers": aux_layers,
        "tensors": tensors, "num_records": sum(s["num_records"] for s in shards), "num_tokens": tokens,
        "num_loss_tokens": sum(s["num_loss_tokens"] for s in shards), "num_bytes": num_bytes,
        "bytes_per_token": {"stored": num_bytes / max(tokens, 1), "minimum": per_token},
        "shards": shards,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_tools.precompute", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. output_dir=DIR model.path=DIR data=sharegpt_dummy")
    parser.add_argument("--config-name", default="precompute", help="config in conf/ (default precompute)")
    parser.add_argument("--dry-run", action="store_true", help="print the storage estimate and stop")
    parser.add_argument("--force", action="store_true", help="start even when the estimate exceeds the free space")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = compose(args.config_name, args.overrides)
    if args.dry_run:
        cfg.precompute.dry_run = True
    if args.force:
        cfg.precompute.force = True
    if args.no_progress:
        cfg.precompute.progress = False
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
