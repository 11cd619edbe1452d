"""Tensor parallelism: the process group, the sharded layers, and rank 0's step broadcast.

One scheduler runs on rank 0. Every rank builds the same models (each loading only its shard of them) and the
same ModelRunners in the same order; a tensor-parallel runner on rank 0 broadcasts each step's inputs (a header,
then one byte buffer) before running it, and every other rank's `serve_forever` loop runs the same forward on
its shard and its own KV cache (the same page ids). A draft LM stays whole on rank 0: its plain runner
broadcasts nothing, so the other ranks just wait for the next target step.

Layers split as in Megatron-LM: column-parallel projections keep a rank's output features (its heads, its
slice of the MLP), row-parallel ones its input features and all-reduce their outputs; the embedding and the
lm_head split the vocabulary, and the logits are all-gathered, so the sampler sees whole rows.

A rank that fails writes its one-line error into the rendezvous store and leaves the group: the other ranks'
next collective fails, and they raise that error (`RemoteRankError`) instead of waiting forever.

A world of T x D ranks may also hold D data-parallel replicas of T ranks each (`init_tp(T, replicas=True)`: the
feature precompute, a trainer's validation); each replica is its own process group with its own rank 0.
"""

from infer.parallel.group import (
    RemoteRankError, ShardingError, TPGroup, attach_where_it_lives, current, divisors, init_tp, one_line,
    sharding_over, single_rank,
)
from infer.parallel.layers import (
    ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Shard, VocabParallelEmbedding, check_split,
    column_linear, group_of, head_spans, lm_head_linear, parameter_bytes, row_linear, vocab_embedding, whole_weight,
)
from infer.parallel.processes import fail, spawn, tp_main
from infer.parallel.step_broadcast import (
    broadcast_step, on_rank0, receive_step, register_runner, serve_forever, stop_workers,
)

__all__ = [
    "ColumnParallelLinear", "ParallelLMHead", "RemoteRankError", "RowParallelLinear", "Shard", "ShardingError",
    "TPGroup", "VocabParallelEmbedding", "attach_where_it_lives", "broadcast_step", "check_split", "column_linear",
    "current", "divisors", "fail", "group_of", "head_spans", "init_tp", "lm_head_linear", "on_rank0", "one_line",
    "parameter_bytes", "receive_step", "register_runner", "row_linear", "serve_forever", "sharding_over",
    "single_rank", "spawn", "stop_workers", "tp_main", "vocab_embedding", "whole_weight",
]
