"""Attention over the paged KV cache, behind one interface with two backends.

A backend is planned once per step from the step's `PageMetadata` (all layers share the plan) and then
called by every layer. Two attention kinds are served:
  - `attend`:     grouped-query attention; the layer's cache is [num_pages, 2, page_size, kv_heads, head_dim]
                  (FlashInfer's NHD layout, K at index 0, V at 1).
  - `attend_mla`: DeepSeek's multi-head latent attention in its absorbed form: queries already multiplied
                  by W_UK, keys are [compressed latent ; rope key] shared by all heads, values are the latent.
                  Caches: ckv [num_pages, page_size, kv_lora_rank] and kpe [num_pages, page_size, rope_dim]
                  (FlashInfer's MLA layout).
`TorchAttention` groups a step's sequences by query length, gathers each group's keys into a batch (or reads them
from the mirror it keeps while its forwards attend the same sequences) and calls SDPA (CPU, tests);
`FlashInferAttention` runs FlashInfer's paged kernels (GPU), imported only when chosen. A step may ask for one
output row per sequence (`PageMetadata.output_rows`: a one-layer head's catch-up); a backend says which rows it
computed in its own `output_rows`.
"""

from infer.attention.backend import AttentionBackend, cast, kv_rows, write_kv, write_mla
from infer.attention.buckets import KV_BUCKET_MIN, additive_mask, kv_buckets
from infer.attention.flashinfer_backend import FlashInferAttention, flashinfer_available, resolve_backend_name
from infer.attention.groups import MATMUL_ATTENTION_MIN_SEQS
from infer.attention.mirror import MIRROR_BYTES, KVMirror
from infer.attention.packed import PackedCausalAttention
from infer.attention.torch_backend import TorchAttention

__all__ = [
    "KV_BUCKET_MIN", "MATMUL_ATTENTION_MIN_SEQS", "MIRROR_BYTES", "AttentionBackend", "FlashInferAttention",
    "KVMirror", "PackedCausalAttention", "TorchAttention", "additive_mask", "cast", "flashinfer_available",
    "kv_buckets", "kv_rows", "resolve_backend_name", "write_kv", "write_mla",
]
