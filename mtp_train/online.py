"""features=online: the target computes each micro batch's features inside the training job, nothing written.

The W training ranks hold W / online.tp copies of the target, copy d over ranks [d*tp, (d+1)*tp) (infer.parallel's
replicas, each rank 1/tp of the weights). Before a micro batch is collated, every rank of a copy runs the same
prefill-only forwards through `infer/` (data_tools.precompute's `FeatureExtractor`: whole records packed under a
token budget, no decode, no chunked prefill, no prefix reuse) over the records of all its ranks' micro batches, in
lockstep (no step broadcast: each rank knows the records), and keeps its own records' last-layer and aux-layer
states in memory, of each record's first trainer.seq_len tokens (all that training reads). The records are
data_tools.precompute's, in its order, so record i online is record i of a precompute of the same data: the same
split, the same micro batches (mtp_train.data), a pure function of the seed.
A resumed run asks only for the micro batches it has yet to train, so the target never reruns the trained ones.
The loss's next-token distribution comes from the last hidden state on the training rank (mtp_train.unroll), as
offline: no full-vocabulary logits are gathered.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from data_tools.config import ConfigError
from data_tools.conversations import DataError
from data_tools.precompute import FeatureExtractor, load_records, model_identity, shard_fingerprint, tokenizer_identity
from data_tools.tokenize import TokenizedRecord
from infer import parallel
from infer.loader import DTYPES, load_config, load_model


class OnlineError(ValueError):
    """A record or configuration the online target cannot compute features for; the message names it."""


def copy_group(tp: int, device: torch.device) -> parallel.TPGroup:
    """This rank's copy of the target: a group of `tp` consecutive ranks (W % tp must be 0: a one-line error naming
    online.tp). Made by every rank, in the same order as the trainer's other groups."""
    with parallel.sharding_over(parallel.current()):  # training's own modules stay whole
        return parallel.init_tp(tp, device, replicas=True, option=f"online.tp={tp}")


def fits_target(records: list[TokenizedRecord], max_positions: int | None, on_error: str) -> list[TokenizedRecord]:
    """The records the target can prefill whole: one longer than its max_position_embeddings is a counted, reported
    skip (data.on_error=skip) or a one-line error (fail), never cut silently. The same on every rank."""
    if not max_positions:
        return records
    long = [r for r in records if len(r) > max_positions]
    if long and on_error == "fail":
        raise OnlineError(f"record {long[0].source} has {len(long[0])} tokens, more than the target's "
                          f"max_position_embeddings={max_positions} (data.on_error=fail; set data.max_length lower)")
    if long:
        print(f"note: skipped {len(long)} of {len(records)} records longer than the target's max_position_embeddings="
              f"{max_positions} (first: {long[0].source})", file=sys.stderr)
    return [r for r in records if len(r) <= max_positions]


class OnlineFeatures:
    """The records as a FeatureDataset-like map (len, num_tokens, item i), item i's states computed by this rank's
    copy of the target: `prepare` runs a micro batch's forwards for the copy's ranks, `__getitem__` hands them out.

    An item not prepared is computed alone on access: every rank of the copy must then ask for the same items in
    the same order (the draft vocabulary's scan does; the held-out set is prepared whole on every rank)."""

    def __init__(self, cfg, group: parallel.TPGroup, aux_layers: tuple[int, ...], device: torch.device,
                 progress: bool = False) -> None:
        o, model_dir = cfg.online, Path(cfg.model.path)
        self.group, self.aux_layers = group, list(aux_layers)
        self.seq_len = cfg.trainer.seq_len  # a record's first seq_len tokens are all training reads (data.collate)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        try:
            records, report = load_records(cfg.data, tokenizer, progress)
        except DataError as err:
            raise OnlineError(str(err)) from err
        config = load_config(model_dir)
        self.records = fits_target(records, getattr(config, "max_position_embeddings", None), cfg.data.on_error)
        self.report = report
        if not self.records:
            raise OnlineError(f"data: no record fits the target ({report.summary()})")
        with parallel.sharding_over(group):  # this rank's 1/tp of the target, in the forward's precision
            model = load_model(model_dir, dtype=DTYPES[o.model_dtype], device=device)
            longest = min(max(len(r) for r in self.records), self.seq_len)
            self.extractor = FeatureExtractor(model, DTYPES[o.dtype], sorted(set(aux_layers)),
                                              max(o.max_tokens_per_batch, longest), o.max_records_per_batch,
                                              o.page_size, o.attention_backend, lockstep=True)
        self.cache: dict[int, dict] = {}
        self.records_computed = 0  # records this rank's copy ran through the target (a resumed run: only new ones)
        self.forward_s = 0.0
        settings = {"dtype": o.dtype, "model_dtype": o.model_dtype, "tp": group.size, "aux_layers": sorted(aux_layers)}
        ident = {"model": model_identity(model_dir), "tokenizer": tokenizer_identity(model_dir, cfg.data, tokenizer)}
        self.identity = {"online": settings, "target": ident["model"],
                         "tokenizer_sha256": hashlib.sha256(json.dumps(ident["tokenizer"], sort_keys=True)
                                                            .encode()).hexdigest(),
                         "num_records": len(self.records),
                         "records_sha256": shard_fingerprint("", self.records)}

    # --- the FeatureDataset interface the trainer's data code reads -------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def num_tokens(self, index: int) -> int:
        return len(self.records[index])

    def __getitem__(self, index: int) -> dict:
        if index not in self.cache:  # computed alone and not kept: a scan over many records holds one at a time
            self.compute([index])
            return self.cache.pop(index)
        return self.cache[index]

    # --- computing --------------------------------------------------------------------------------------------
    def prepare(self, shares: list[list[int]]) -> None:
        """Every rank's records of one micro batch (mtp_train.data.MicroBatches): the forwards for this copy's
        ranks, run by each of them alike; the states of earlier micro batches are let go."""
        first = self.group.replica * self.group.size
        ids = sorted({i for share in shares[first : first + self.group.size] for i in share})
        self.cache = {}
        self.compute(ids)

    def compute(self, ids: list[int]) -> None:
        """The states of records `ids` (sorted, the same list on every rank of the copy) into the cache."""
        start = time.perf_counter()
        records = [self.records[i] for i in ids]
        lengths = [min(len(r), self.seq_len) for r in records]  # the tokens training reads: no longer prefill
        out_dtype = self.extractor.out_dtype
        with parallel.sharding_over(self.group):
            for batch in self.extractor.batches(lengths):
                try:
                    states, aux = self.extractor.forward([records[j].input_ids[: lengths[j]] for j in batch])
                except RuntimeError as err:  # noqa: PERF203 - a failed forward: name the record, one line
                    raise OnlineError(f"online: the target's forward failed on records "
                                      f"{[records[j].source for j in batch][:3]}: {parallel.one_line(err)}") from err
                row = 0
                for j in batch:
                    n, record = lengths[j], records[j]
                    # clone(): out of inference mode, so the states can enter the head's autograd graph
                    item = {"input_ids": torch.tensor(record.input_ids[:n], dtype=torch.long),
                            "loss_mask": torch.tensor(record.loss_mask[:n], dtype=torch.bool),
                            "hidden_states": states[row : row + n].to(out_dtype).clone(), "source": record.source}
                    if self.aux_layers:
                        item["aux_hidden_states"] = torch.stack(
                            [aux[layer][row : row + n].to(out_dtype) for layer in self.aux_layers], dim=1).clone()
                    self.cache[ids[j]] = item
                    row += n
        self.records_computed += len(ids)
        self.forward_s += time.perf_counter() - start


def check_online(cfg, world: int) -> None:
    """The online settings against the world, before any weight is read: one-line errors naming the key."""
    if world % cfg.online.tp:
        raise ConfigError(f"online.tp={cfg.online.tp} must divide the {world} training ranks (W / online.tp copies of "
                          "the target): choose online.tp in " + str(parallel.divisors(world)))
