"""The block head's drafter (infer.models.block_head) behind the drafter seam of infer.speculative.

Catch-up (`propose`, after every target forward): every row the forward computed is projected into the head's
context keys/values (fc + hidden_norm of the target layers it reads, then each layer's k/v, rotated at the row's
position) and written into the head's per-layer cache at the row's slot, on the target's own page tables. Rows past
a verify's accepted prefix are written too: a draft reads only the settled positions, and the next target forward
rewrites those slots before they are settled. An `anchor_input` head's mask rows read c_{p-1} too: every row's
context feature is kept a slot (`anchor_cache`), and a step gathers each request's at its last settled position.

A step (`draft`): one forward of the block, B rows a request at positions p..p+B-1 (p = num_computed, the pending
token's position) reading the context slots 0..p-1 gathered from the pages; its rows 1..K give the K drafts, then
`speculative_decode` verifies them in one target forward of K+1 rows. K may be below the head's B-1 (its first K
drafts of the trained block, as DFlash runs it). With `short_blocks` a step of K drafts runs K + 1 rows instead, so
that the forward costs with K: a block shorter than trained is off the training distribution (on one head it kept
acceptance, on another it lost the first draft: docs/block_head.md), so it is an option, not the default.

Proposals at T>0 (`EngineConfig.block_proposals`, BLOCK_PROPOSALS): "argmax", every row's argmax with a one-hot q
(DFlash's answer to its finding that independent per-position draws collapse acceptance: row k's distribution is a
marginal over the drafts before it, not conditioned on them), or "sample", a draw from every row's own distribution,
q being that distribution. Both are lossless under rejection sampling: the verifier is given the distribution each
proposal was drawn from. Which accepts more depends on the target: docs/block_head.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from infer.cuda_graphs import GraphSettings
from infer.device_copy import device_tensor
from infer.sampler import SamplingTensors, sample, target_probs
from infer.speculative import DRAFTERS, Drafter, SpeculatingRequest, TargetRows


BLOCK_PROPOSALS = ("argmax", "sample")  # a block head's drafts at T > 0 (module docstring)


class BlockDrafter(Drafter):
    kind = "block"
    needs_hidden_states = True

    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str,
                 graphs: GraphSettings | None = None, proposals: str = "argmax", short_blocks: bool = False) -> None:
        """graphs: accepted as every drafter's, unused: the block forward runs eagerly (its context gather and
        whole-block attention are not in the graph runner's shapes)."""
        super().__init__(model, num_pages, page_size, backend)
        self.target_aux_layers = tuple(model.target_aux_layers)
        self.block_size = int(model.config.block_size)
        if proposals not in BLOCK_PROPOSALS:
            raise ValueError(f"block_proposals={proposals!r}: choose one of {', '.join(BLOCK_PROPOSALS)}")
        self.proposals = proposals
        self.short_blocks = short_blocks
        # an anchor_input head's mask rows read c_{p-1}: every position's context feature, a row per slot
        self.anchor_cache = torch.zeros(num_pages * page_size, model.config.hidden_size, dtype=self.runner.dtype,
                                        device=self.device) if model.config.anchor_input else None

    @property
    def head(self) -> torch.nn.Module:
        return self.runner.model

    def propose(self, rows: TargetRows) -> None:
        """Project every row's context keys/values into the cache at its slot (no block forward here)."""
        start = time.perf_counter()
        out = rows.output
        aux = torch.stack([out.aux_hidden_states[layer] for layer in self.target_aux_layers], dim=1)  # [T, n, H]
        features = self.head.features(out.hidden_states, aux.to(self.runner.dtype))
        for cache, kv in zip(self.runner.kv_caches, self.head.context_kv(features, rows.meta.positions)):
            cache.index_copy_(0, rows.meta.slot_mapping, kv.to(cache.dtype))
        if self.anchor_cache is not None:
            self.anchor_cache.index_copy_(0, rows.meta.slot_mapping, features.to(self.anchor_cache.dtype))
        elapsed = time.perf_counter() - start
        self.runner.forward_s += elapsed
        self.seconds += elapsed

    def block_rows(self, k: int) -> int:
        """Rows of the block a step of k drafts runs: the trained block_size, or with `short_blocks` k + 1 (the
        pending token and k mask rows: a forward that costs with K, at the price of fewer mask rows than trained)."""
        return k + 1 if self.short_blocks else self.block_size

    def block_logits(self, requests: Sequence[SpeculatingRequest], rows: int | None = None,
                     num_drafts: int | None = None) -> Tensor:
        """[B, num_drafts or rows - 1, V] each request's draft logits from one block forward of `rows` rows (default:
        the trained block) over its settled context."""
        device, size = self.device, self.page_size
        lens = [r.num_computed for r in requests]  # context length = pending position; on the host: no device read
        longest, width = max(max(lens), 1), max(len(r.page_table.pages) for r in requests)
        pages = device_tensor([r.page_table.pages + [0] * (width - len(r.page_table.pages)) for r in requests],
                              device)  # [B, max pages], one copy
        lens_t = device_tensor(lens, device)
        pos = torch.arange(longest, device=device)
        valid = pos[None, :] < lens_t[:, None]  # [B, L]
        page_index = (pos // size).clamp(max=width - 1).expand(len(requests), -1)
        slots = torch.where(valid, pages.gather(1, page_index) * size + pos % size, 0)  # [B, L]
        flat = slots.flatten()  # index_select: one gather kernel, where cache[slots] indexes in general
        context = [cache.index_select(0, flat).view(*slots.shape, *cache.shape[1:])
                   for cache in self.runner.kv_caches]  # per layer [B, L, 2, kvh, D]
        positions = lens_t[:, None] + torch.arange(rows or self.block_size, device=device)  # [B, rows]
        first = device_tensor([r.token_ids[-1] for r in requests], device)
        anchor = None if self.anchor_cache is None else self.anchor_cache.index_select(
            0, slots.gather(1, (lens_t - 1).clamp(min=0)[:, None]).flatten())  # [B, H] c_{p-1}
        # contexts of one length (batch 1 always): no padded key to hide, no mask to build or add
        valid = None if min(lens) == longest else valid
        return self.head(first, positions, context, valid, num_drafts, anchor)

    def draft(self, requests: Sequence[SpeculatingRequest], k: int, sampling: SamplingTensors,
              generators: Sequence[torch.Generator]) -> tuple[Tensor, Tensor | None]:
        """k drafts a request from one block forward: ([B, k] ids, [B, k, V] their q, or None when greedy)."""
        if not 1 <= k < self.block_size:
            raise ValueError(f"num_draft_tokens={k}: a block head of block_size {self.block_size} drafts 1.."
                             f"{self.block_size - 1} tokens a step")
        start = time.perf_counter()
        logits = self.block_logits(requests, self.block_rows(k), k)  # [B, k, V]
        self.runner.forward_s += time.perf_counter() - start
        if sampling.all_greedy:
            tokens, probs = logits.argmax(-1), None
        elif self.proposals == "sample":  # each row's draw, q its distribution
            tokens = torch.stack([sample(logits[:, j], sampling, generators) for j in range(k)], dim=1)
            probs = torch.stack([target_probs(logits[:, j], sampling.temperature, sampling.top_k, sampling.top_p)
                                 for j in range(k)], dim=1)
        else:  # the argmax, its distribution a one-hot q
            tokens = logits.argmax(-1)
            probs = torch.nn.functional.one_hot(tokens, logits.shape[-1]).float()
        self.seconds += time.perf_counter() - start
        return tokens, probs


DRAFTERS[BlockDrafter.kind] = BlockDrafter  # registered here, so infer.speculative stays as it is
