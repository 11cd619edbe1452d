"""Precompute the target's features through the inference runtime: sharded safetensors plus a manifest.

    python -m data_tools.precompute output_dir=DIR [model=stories260k model.path=DIR] [data=sharegpt_dummy] ...
    python -m data_tools.precompute --dry-run output_dir=DIR          # the storage estimate alone
    torchrun --standalone --nproc_per_node 2 -m data_tools.precompute output_dir=DIR
    torchrun --standalone --nproc_per_node 8 -m data_tools.precompute precompute.tp=4 ...   # 2 replicas of 4 ranks

Arguments after the flags are Hydra overrides of conf/precompute.yaml (its model and data groups, conf/model/
and conf/data/, are the trainer's; model.path is the target's Hugging Face folder). Steps:
  1. load and validate the conversations, tokenize them (loss mask on assistant tokens), print the counts;
  2. cut the record list into shards of records_per_shard records (fixed up front, so every rank and every
     rerun agrees on what each shard holds); the WORLD_SIZE ranks form D = WORLD_SIZE / precompute.tp replicas
     of tp ranks, each holding 1/tp of the target (infer.parallel), and replica d computes shards d, d + D, ...:
     its rank 0 runs them and writes each shard once, its other ranks run the same forwards on their shards;
  3. print the storage estimate (bytes per token x tokens) and refuse to start when the disk cannot hold it;
  4. per shard: pack its records (longest first) into variable-length batches under a token budget, run
     each through `infer/` (pages from a PagePool, `build_page_metadata`, `ModelRunner.run` with the chosen
     aux layers, pages freed), and write each batch's rows straight into the shard's temporary file at their
     final offsets (memory holds one batch, not the shard), renamed into place when complete; a shard already
     on disk from the same run is skipped, so a rerun after a kill finishes the job with the same bytes as an
     uninterrupted run;
  5. after a barrier, rank 0 writes manifest.json (shapes, dtypes, counts, sources, sha256 per shard, the
     identity of model and tokenizer), also atomically.
The output folder must be new, empty, or one of precompute's own: a file there that precompute did not write
is refused by name, never overwritten.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import AutoTokenizer

from data_tools.config import compose
from data_tools.conversations import DataError, LoadReport, load_conversations
from data_tools.shards import (
    FORMAT, MANIFEST, OFFSET_BYTES, ShardWriter, atomic_file, aux_key, bytes_per_token, is_own_file,
    read_manifest, read_shard_meta, sha256_file, shard_name, write_manifest,
)
from data_tools.tokenize import PLAIN, ChatFormat, TokenizedRecord, pack_by_budget
from infer.cli import run_cli
from infer.kv_cache import PagePool, PageTable, build_page_metadata, pages_needed
from infer.loader import DTYPES, load_config, load_model, safetensors_files
from infer.model_runner import ModelRunner
from infer.models.block_head import block_aux_layers
from infer.models.eagle3_head import head_aux_layers
from infer.models.head_base import HeadLoadError
from infer.parallel import init_tp, on_rank0

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
HEADER_BYTES = 1024  # per-shard safetensors header, before the records' sources


# --- configuration ------------------------------------------------------------------------------------
def chat_format(data_cfg: DictConfig, tokenizer) -> ChatFormat:
    return ChatFormat(tokenizer, chat_template=data_cfg.chat_template, end_token=data_cfg.end_token,
                      max_length=data_cfg.max_length, truncate=data_cfg.truncate)


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


def check_output_dir(out_dir: Path) -> None:
    """Refuse a folder holding anything but precompute's own files (shards, manifest, their temporary files):
    precompute overwrites and resumes its own work only, never a user's file that shares the folder. A file with
    a shard's name counts as precompute's only when its header says so."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"output_dir={out_dir} is not a folder")
    for path in sorted(out_dir.iterdir()) if out_dir.is_dir() else []:
        own = is_own_file(path.name) and path.is_file() and not path.is_symlink()
        if own and path.suffix == ".safetensors":
            meta = read_shard_meta(path)
            own = isinstance(meta, dict) and meta.get("format") == FORMAT
        if not own:
            raise DataError(f"{path} was not written by precompute (or is damaged): output_dir={out_dir} must be new, "
                            f"empty or precompute's own; move the file away or choose another output_dir")
    if (out_dir / MANIFEST).is_file():
        try:
            read_manifest(out_dir)
        except DataError as err:
            raise DataError(f"{err}; precompute never overwrites a manifest it did not write: move it away or "
                            f"choose another output_dir") from err


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
                 max_records: int, page_size: int = 16, backend: str = "auto", lockstep: bool = False) -> None:
        self.model = model
        # lockstep: every rank of a tensor-parallel group calls forward with the same records (online training),
        # so each runs its shard directly; else rank 0 broadcasts each step to the others' serve_forever
        self.lockstep = lockstep
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
            if self.lockstep:
                with torch.inference_mode():
                    out = self.runner.forward(ids, meta, no_logits, aux_layers=self.aux_layers)
            else:
                out = self.runner.run(ids, meta, no_logits, aux_layers=self.aux_layers)
        finally:
            for table in tables:
                table.free()
        return out.hidden_states, out.aux_hidden_states

    def write_shard(self, f: BinaryIO, records: list[TokenizedRecord], meta: dict, bar: tqdm | None = None) -> None:
        """The shard of `records` into the open file f: each batch's rows go to their final offsets as soon as
        they are computed, so memory holds one batch's states, not the shard (see shards.ShardWriter)."""
        lengths = [len(r) for r in records]
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        rows = (int(offsets[-1]), self.hidden_size)
        shapes = {"input_ids": (torch.int32, rows[:1]), "loss_mask": (torch.uint8, rows[:1]),
                  "hidden_states": (self.out_dtype, rows), "record_offsets": (torch.int64, (len(records) + 1,)),
                  **{aux_key(layer): (self.out_dtype, rows) for layer in self.aux_layers}}
        writer = ShardWriter(f, shapes, meta)
        writer.write("input_ids", 0, torch.tensor([t for r in records for t in r.input_ids], dtype=torch.int32))
        writer.write("loss_mask", 0, torch.tensor([m for r in records for m in r.loss_mask], dtype=torch.uint8))
        writer.write("record_offsets", 0, offsets)
        for batch in self.batches(lengths):
            states, aux_states = self.forward([records[i].input_ids for i in batch])
            stored = {"hidden_states": states.to(self.out_dtype).cpu()}
            stored.update({aux_key(layer): aux_states[layer].to(self.out_dtype).cpu() for layer in self.aux_layers})
            row = 0
            for i in batch:  # the batch holds its records' rows one after another
                for name, tensor in stored.items():
                    writer.write(name, int(offsets[i]), tensor[row : row + lengths[i]])
                row += lengths[i]
            if bar is not None:
                bar.update(row)


# --- the run ------------------------------------------------------------------------------------------
def write_shards(extractor: FeatureExtractor, plans: list[ShardPlan], out_dir: Path, progress: bool) -> None:
    """Compute and write `plans` (a replica's rank 0: the others run its forwards), each atomically."""
    bar = tqdm(total=sum(p.num_tokens for p in plans), desc="precompute", unit="tok", unit_scale=True,
               disable=not progress, dynamic_ncols=True)
    for plan in plans:
        meta = {"format": FORMAT, "shard": plan.index, "fingerprint": plan.fingerprint,
                "sources": [r.source for r in plan.records]}
        with atomic_file(out_dir / plan.name) as f:
            extractor.write_shard(f, plan.records, meta, bar)
    bar.close()


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
    if cfg.head.architecture in ("eagle3", "block"):
        try:
            aux_layers += (head_aux_layers(model_config, cfg.head.layer_ids) if cfg.head.architecture == "eagle3"
                           else block_aux_layers(model_config, cfg.head.layer_ids))
        except HeadLoadError as err:
            raise DataError(str(err)) from err
    return DTYPES[pc.dtype], DTYPES[pc.model_dtype], sorted(set(aux_layers))


def run(cfg: DictConfig) -> dict | None:
    """The whole precompute; returns the manifest on rank 0 (None on other ranks and for a dry run)."""
    pc = cfg.precompute
    tp = init_tp(pc.tp, pc.device, replicas=True, option=f"precompute.tp={pc.tp}")  # this rank's replica
    rank, world = tp.global_rank, tp.size * tp.replicas
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    progress = pc.progress and rank == 0
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
    check_output_dir(out_dir)
    plans = plan_shards(records, pc.records_per_shard, settings_sha, out_dir, pc.overwrite)

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
    free = check_disk(needed, out_dir, pc.force)
    log(f"free on disk: {human_bytes(free)}")
    _barrier(world)  # every rank has checked the folder before any rank writes to it
    out_dir.mkdir(parents=True, exist_ok=True)

    mine = [p for p in pending if p.index % tp.replicas == tp.replica]
    if mine:  # every rank of the replica builds its shard of the model and the same runner
        model = load_model(model_dir, dtype=model_dtype, device=tp.device)
        longest = max(len(r) for p in mine for r in p.records)
        extractor = FeatureExtractor(
            model, out_dtype, aux_layers, max(pc.max_tokens_per_batch, longest), pc.max_records_per_batch,
            pc.page_size, pc.attention_backend,
        )
        on_rank0(functools.partial(write_shards, extractor, mine, out_dir, progress), tp)

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
    return manifest


def build_manifest(cfg: DictConfig, plans: list[ShardPlan], identity: dict, report: LoadReport, hidden: int,
                   per_token: int, aux_layers: list[int], out_dir: Path) -> dict:
    """The manifest of the finished shards. A shard this run skipped keeps the sha256 the previous manifest
    gave it (same fingerprint): one damaged since is refused, not listed anew as if it were sound."""
    listed = {s["file"]: s for s in read_manifest(out_dir)["shards"]} if (out_dir / MANIFEST).is_file() else {}
    shards = []
    for plan in plans:
        path = out_dir / plan.name
        meta = read_shard_meta(path)
        if meta is None or meta.get("fingerprint") != plan.fingerprint:
            raise DataError(f"{path} is missing or from another run after all ranks finished")
        digest, before = sha256_file(path), listed.get(plan.name, {})
        if plan.done and before.get("fingerprint") == plan.fingerprint and before.get("sha256") != digest:
            raise DataError(f"{path} changed after {out_dir / MANIFEST} listed it (damaged on disk): delete it and "
                            "rerun this command, which recomputes only missing shards")
        shards.append({
            "file": plan.name, "num_records": len(plan.records), "num_tokens": plan.num_tokens,
            "num_loss_tokens": sum(sum(r.loss_mask) for r in plan.records), "bytes": path.stat().st_size,
            "sha256": digest, "fingerprint": plan.fingerprint, "sources": [r.source for r in plan.records],
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
    if dist.is_initialized():  # here, not in run: a caller in a training job keeps its process group
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
