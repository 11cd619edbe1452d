"""Paged attention in plain PyTorch (CPU, tests): the step's groups and a mirror of their keys, then SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.attention.backend import cast, write_kv, write_mla
from infer.attention.buckets import kv_buckets
from infer.attention.groups import SHORT_QUERIES, QueryGroup
from infer.attention.mirror import MIRROR_SLACK, KVMirror
from infer.kv_cache import DecodeSteps, PageMetadata


def _first_pages(meta: PageMetadata) -> torch.Tensor:
    host = meta.on_host()
    return host.kv_indices[host.kv_indptr[:-1]]


class TorchAttention:
    """Paged attention in plain PyTorch: per group of query lengths (see QueryGroup), gather the sequences' keys into
    a batch, then SDPA.

    Everything that depends only on the page tables (groups, gather indices, masks) is built in `plan`, once per
    step, so each layer costs one scatter, and per group one gather and one SDPA call. While successive forwards
    attend the same sequences as one group (a speculating batch's verify forwards, a drafter's catch-ups and
    drafts, decode steps), each GQA layer keeps their keys in a `KVMirror` (within MIRROR_BYTES) and reads them
    from it as a view: no gather per forward, and no gather indices to build. A decode run (DecodeSteps) is
    planned once, on its first step: every step reads the keys of the last, masked.
    """

    def __init__(self) -> None:
        self._run = None
        self._mirror: KVMirror | None = None
        # what this forward writes into the mirror: (q_lens, positions), or a decode run and its step
        self._mirror_tokens: tuple | None = None
        self.mirror_write = None  # this forward's rows in the mirror's blocks, None when it reads no mirror
        self.output_rows = None

    def plan(self, meta: PageMetadata) -> None:
        # Caches are read and written through flat views with index_copy_/index_select (one kernel each, far
        # cheaper than multi-dimensional indexing); the writes' rows come with the metadata (cache_rows), the reads'
        # are derived on the step's first layer that gathers (QueryGroup.kv_read / read_slots), so a model pays only for
        # the cache layout it has.
        self.page_size = meta.page_size
        self.write_slots, self.kv_write = meta.slot_mapping, meta.cache_rows
        self.mirror_write = self._mirror_tokens = self.output_rows = None
        if meta.decode_run is not None:
            self._plan_decode_step(meta)
            return
        self._run = None
        batch, host = meta.batch_size, meta.on_host()  # the lengths as built on the host: no device sync
        kv_lens = host.kv_lens.tolist()
        q_lens = [1] * batch if meta.max_q_len == 1 else (host.qo_indptr[1:] - host.qo_indptr[:-1]).tolist()
        if meta.output_rows is not None and meta.max_q_len > 1:  # those rows attend, as decodes at their positions
            self.output_rows = meta.output_rows
            row_kv_lens = meta.positions[meta.output_rows] + 1  # [B] the keys each row sees
            self.groups = [QueryGroup(meta, None, [1] * batch, row_kv_lens.tolist(), row_kv_lens)]
            self._keep_mirror(meta, max(kv_lens))  # it holds what the forward writes
            self._mirror_tokens = (q_lens, meta.positions)  # every token's K/V is written
            return
        short, by_q_len = [], {}  # the short queries; each longer query length's sequences
        for b, q_len in enumerate(q_lens):
            if q_len > SHORT_QUERIES:
                by_q_len.setdefault(q_len, []).append(b)
            else:
                short.append(b)
        # the short queries by kv length (a group's keys are padded to its longest)
        groupings = (kv_buckets(short, kv_lens) if short else []) + list(by_q_len.values())
        if len(groupings) == 1:
            self.groups = [QueryGroup(meta, None, q_lens, kv_lens)]
            if not self.groups[0].fresh:
                self._keep_mirror(meta, max(kv_lens))
                self._mirror_tokens = (q_lens, meta.positions)
                return
        else:
            device = meta.positions.device
            self.groups = [QueryGroup(meta, torch.tensor(seqs, device=device), [q_lens[b] for b in seqs],
                                  [kv_lens[b] for b in seqs]) for seqs in groupings]
            self.out_rows = torch.cat([g.out_rows for g in self.groups])  # where each group's outputs go
        self._mirror = None  # other sequences, or several groups: the next forward over one group gathers anew

    def forget(self) -> None:
        """Drop what it keeps between forwards (the mirror, the decode run's plan): a forward it did not run (a CUDA
        graph's, `infer.cuda_graphs`) wrote K/V its mirror lacks."""
        self._mirror = self._run = None
        self._run_mirror = None

    def serves_decode_run(self, kv_lens: list[int]) -> bool:
        """A run attends as one group, keys padded to the run's longest: not where a step would split the batch
        by kv length (`kv_buckets`)."""
        return len(kv_buckets(list(range(len(kv_lens))), kv_lens)) == 1

    def _keep_mirror(self, meta: PageMetadata, max_kv: int) -> KVMirror:
        """The mirror of this forward's sequences: the one kept, or a new one, whose blocks the layers build as they
        first read (the rows of the sequences the last one held copied from it, `KVMirror.inherit`; the others
        gathered from the pages)."""
        first_pages, mirror = _first_pages(meta), self._mirror
        held = mirror is not None and mirror.holds(first_pages)
        if not held or max_kv > mirror.capacity:
            # outgrown by the same sequences: twice the longest, so a batch that decodes on regathers a few times
            capacity = max(max_kv + MIRROR_SLACK, 2 * max_kv if held else 0)
            self._mirror = KVMirror(first_pages, -(-capacity // self.page_size) * self.page_size)
            if mirror is not None:  # it was current up to the last forward: its rows go over, not the pages
                self._mirror.inherit(mirror)
        return self._mirror

    def _plan_decode_step(self, meta: PageMetadata) -> None:
        """Step j of a DecodeSteps run (the draft forwards, plain decode runs): its first step plans every step.

        All steps read the keys of the run's last step (the longest: each sequence's pages up to it) and mask the
        positions step j has not written yet: one gather plan and one mask build for the run instead of one per step.
        """
        run = meta.decode_run
        if run is not self._run:
            self._run = run
            last = run.step(run.num_steps - 1)
            self._run_group = QueryGroup(last, None, [1] * last.batch_size, last.on_host().kv_lens.tolist())
            self._run_visible = run.kv_lens[:, :, None]  # [S, B, 1]: the run's masks are built once
            self._run_mirror = None
        group = self._run_group
        group.set_visible(self._run_visible, meta.decode_step)
        self.groups = [group]
        if self._mirror is None or self._mirror is not self._run_mirror:  # the run's mirror serves all its steps
            # another mirror: the run's rows in its blocks are built anew, by the first layer that writes into it
            self._run_mirror, self._run_mirror_writes = self._keep_mirror(meta, group.read_shape[1]), None
        self._mirror_tokens = (run, meta.decode_step)

    def _read_kv(self, flat: torch.Tensor, group: QueryGroup, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's keys and values, [n, Hkv, max_kv, D] each: views of the mirror's block for the layer, this
        forward's kv (cat(K, V), as written into the cache) written into it too, or gathered from the cache."""
        mirror = self._mirror
        if mirror is not None and flat.data_ptr() not in mirror.unkept:
            block = mirror.blocks.get(flat.data_ptr())
            held = block is not None
            if not held:
                block, held = mirror.gather(flat, group)  # held: rows came from a mirror of the last forward
            if held:
                if self.mirror_write is None:  # the forward's first kept layer
                    self.mirror_write = self._mirror_rows(*flat.shape[1:])
                mirror.write(block, self.mirror_write, kv)
            if block is not None:
                return mirror.views(block, group.read_shape[1])
        return flat.index_select(0, group.kv_read).view(2, *group.read_shape, *flat.shape[1:]).transpose(2, 3).unbind()

    def _mirror_rows(self, kv_heads: int, dim: int) -> torch.Tensor:
        """Where this forward's keys and values go in the mirror's blocks (a decode run's: built for all its steps
        at once)."""
        if isinstance(self._mirror_tokens[0], DecodeSteps):
            run, step = self._mirror_tokens
            if self._run_mirror_writes is None:
                self._run_mirror_writes = self._mirror.rows([1] * run.batch_size, run.positions, kv_heads, dim)
            return self._run_mirror_writes[:, step].flatten()  # [2, S, B, Hkv(, D)] -> the step's
        return self._mirror.rows(*self._mirror_tokens, kv_heads, dim).flatten()

    def _gather(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """The groups' outputs [n * q_len, H, D] -> [T, H, D] in packed order."""
        if len(outs) == 1:
            return outs[0]
        packed = torch.cat(outs)
        return torch.empty_like(packed).index_copy_(0, self.out_rows, packed)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        kv = cast(torch.cat((k, v)), kv_cache.dtype)  # [2T, Hkv, D]
        flat = write_kv(kv_cache, self.kv_write, kv)
        if self.output_rows is not None:
            q = q.index_select(0, self.output_rows)
        outs = []
        for group in self.groups:
            if group.fresh:
                out = group.unpad(F.scaled_dot_product_attention(
                    group.queries(q), group.queries(k), group.queries(v), is_causal=True, scale=scale, enable_gqa=True
                ))
            else:
                keys, values = (cast(x, q.dtype) for x in self._read_kv(flat, group, kv))  # [n, Hkv, max_kv, D]
                out = group.attend_cached(q, keys, values, scale)
            outs.append(out)
        return self._gather(outs)

    def attend_mla(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        ckv_flat = write_mla(ckv_cache, self.write_slots, ckv)
        kpe_flat = write_mla(kpe_cache, self.write_slots, kpe)
        query_rows = torch.cat((q_latent, q_rope), dim=-1)
        if self.output_rows is not None:
            query_rows = query_rows.index_select(0, self.output_rows)
        outs = []
        for group in self.groups:
            if group.fresh:
                latent = group.queries(ckv[:, None, :])  # [n, 1, q_len, R]
                keys = torch.cat((latent, group.queries(kpe[:, None, :])), dim=-1)
                out = group.unpad(F.scaled_dot_product_attention(group.queries(query_rows), keys, latent,
                                                                 is_causal=True, scale=scale, enable_gqa=True))
            else:
                latent = ckv_flat.index_select(0, group.read_slots).view(*group.read_shape, -1).to(q_latent.dtype)
                rope_key = kpe_flat.index_select(0, group.read_slots).view(*group.read_shape, -1).to(q_latent.dtype)
                keys = torch.cat((latent, rope_key), dim=-1)[:, None]  # one head shared by all query heads
                out = group.attend_cached(query_rows, keys, latent[:, None], scale)
            outs.append(out)
        return self._gather(outs)
