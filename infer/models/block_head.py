"""The block-drafting head (DFlash-style, arXiv 2602.06036): B-1 drafts from one forward.

The head reads the target's fused features at the settled positions 0..p-1 (its "context") and a query block of B
rows at positions p..p+B-1: the last emitted (pending) token's embedding, then B-1 copies of a learned mask
embedding (stories260K's 512-token vocabulary has no spare id to embed instead), or of the target's embedding of
a reserved `mask_token_id` where the config names one. Each of its `num_layers` Llama-shaped
decoder layers attends from the block rows to

    keys/values of the context: k_proj / v_proj of c_j = hidden_norm(fc([h^l1_j ; ... ; h^ln_j]))  (rotated at j)
    keys/values of the block itself: k_proj / v_proj of input_layernorm(x) (rotated at p..p+B-1)

with no mask inside the block (bidirectional) and every context position before p visible ("KV injection": the
context enters through keys and values only, never through the residual stream). Block row k's output, through
final_norm and the target's lm_head (frozen, shared), drafts the token at position p+k, k = 1..B-1.

`anchor_input` (off by default; not in the engines' DFlash formats): each mask row also adds anchor_fc([c_{p-1};
Emb(t_p)]), MTP's first-step input, so that its queries depend on the text from the first layer on; a one-layer head's
mask rows otherwise query by position alone (docs/block_head.md measures both).

The context's keys/values depend on the target alone, so the runtime projects them once, after the target forward
that computed the position (`context_kv`), into a paged cache per layer indexed by the target's page tables; a draft
step then runs the block's B rows alone (infer.block_drafter). Training computes the same `context_kv` over a whole
record and runs many blocks against it (mtp_train.block_unroll).

Shapes and layout follow z-lab/dflash model/dflash.py (a3516f8): k/v of context and block by the same projections,
fc + hidden_norm fusing the target layers, a final norm before the target's lm_head; unlike it (a Qwen3 draft) a
Llama layer has no q/k norms (optional: `qk_norm`, Qwen3's per-head RMSNorm of q and k before rope, on the
context keys too, which the engines' DFlash layers always have), and the mask row is by default a learned vector
rather than a reserved token's embedding.

Layer ids: EAGLE-3's convention (infer.models.eagle3_head): id i is the stream entering decoder layer i, infer's
aux output of layer i - 1; any number of distinct ids in 1..L.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PretrainedConfig

from infer.attention import cast
from infer.models.common import RMSNorm, RotaryEmbedding, apply_rope_half
from infer.models.eagle3_head import default_layer_ids
from infer.models.head_base import DraftHead, HeadLoadError, MTPHeadConfig, repeat_kv_heads
from infer.models.llama import LlamaMLP
from infer.parallel import current

MIN_BLOCK_SIZE = 2  # the pending token and at least one mask row


def block_config_fields(target_config: PretrainedConfig, layer_ids: list[int] | None, block_size: int,
                        num_layers: int, mask_token_id: int | None = None, qk_norm: bool = False,
                        anchor_input: bool = False) -> dict:
    """MTPHeadConfig's block-head fields for a target, checked (HeadLoadError naming the value)."""
    if target_config.model_type != "llama":
        raise HeadLoadError(f"block heads are built for Llama targets, not {target_config.model_type!r}")
    num_target = target_config.num_hidden_layers
    ids = default_layer_ids(num_target) if layer_ids is None else [int(i) for i in layer_ids]
    if not ids or len(set(ids)) != len(ids) or not all(0 < i <= num_target for i in ids):
        raise HeadLoadError(f"head.layer_ids={ids}: a block head fuses distinct target layer ids in 1..{num_target}")
    if block_size < MIN_BLOCK_SIZE:
        raise HeadLoadError(f"head.block_size={block_size}: a block holds the pending token and >= 1 mask row (>= 2)")
    if num_layers < 1:
        raise HeadLoadError(f"head.num_layers={num_layers} must be >= 1")
    if mask_token_id is not None and not 0 <= int(mask_token_id) < target_config.vocab_size:
        raise HeadLoadError(f"head.mask_token_id={mask_token_id} is not a token of the target's "
                            f"{target_config.vocab_size}-token vocabulary")
    return dict(aux_layer_ids=ids, block_size=int(block_size), num_layers=int(num_layers), enorm=False, hnorm=False,
                final_norm=True, proj_bias=False, layer_input_norm=True,
                mask_token_id=None if mask_token_id is None else int(mask_token_id), qk_norm=bool(qk_norm),
                anchor_input=bool(anchor_input))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [N, B, heads, D], k/v [N, S, kv heads, D], mask [N, S] (the keys each block sees; None: all) -> [N, B,
    heads, D].

    The query heads sharing a key/value head are folded into its query rows ([N, kv heads, B * G, D], as
    infer.attention.groups' attend_cached does): one SDPA call reads each key once per kv head, where `enable_gqa`
    copies keys and values out per query head; the mask is additive in q's dtype (a boolean one is converted on every
    call). Half the attention's time at 32 blocks on the CPU (docs/block_head.md)."""
    n, rows, heads, dim = q.shape
    kv_heads = k.shape[2]
    folded = q.reshape(n, rows, kv_heads, heads // kv_heads, dim).transpose(1, 2).reshape(n, kv_heads, -1, dim)
    bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~mask, float("-inf"))[:, None, None]
    out = F.scaled_dot_product_attention(folded, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias)
    return out.view(n, kv_heads, rows, heads // kv_heads, dim).transpose(1, 2).reshape(n, rows, heads, dim)


def block_aux_layers(target_config: PretrainedConfig, layer_ids: list[int] | None) -> list[int]:
    """The infer aux layers (decoder layer i's output) a block head with these ids reads: id - 1 each."""
    return [i - 1 for i in block_config_fields(target_config, layer_ids, MIN_BLOCK_SIZE, 1)["aux_layer_ids"]]


class BlockAttention(nn.Module):
    """q from the block rows; k/v from the context features and from the block rows, by the same projections."""

    def __init__(self, config: LlamaConfig, qk_norm: bool = False) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if qk_norm:  # Qwen3's per-head RMSNorm of q and k before rope, as the engines' DFlash layers have
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> rotated k, v [T, kv heads, head_dim]."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        k = self.k_norm(k) if self.qk_norm else k
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope_half(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_valid: torch.Tensor | None, rows: slice = slice(None)) -> torch.Tensor:
        """x [N, B, H] block rows (normed); cos/sin [N*B, 1, D]; ctx_k/ctx_v [N or 1, L, kv heads, D] rotated;
        ctx_valid [N, L] the context keys each block sees (None: all) -> [N, R, H] at the block rows `rows` (keys
        and values come from every row; only the rows asked for query)."""
        n, b, _ = x.shape
        k, v = self.kv(x.flatten(0, 1), cos, sin)
        queries = x[:, rows]
        r = queries.shape[1]
        q = self.q_proj(queries.flatten(0, 1)).unflatten(-1, (self.num_heads, self.head_dim))
        q_cos, q_sin = (t.unflatten(0, (n, b))[:, rows].flatten(0, 1) for t in (cos, sin))
        q = apply_rope_half(self.q_norm(q) if self.qk_norm else q, q_cos, q_sin)
        k = torch.cat((ctx_k.expand(n, -1, -1, -1), k.unflatten(0, (n, b))), dim=1)  # [N, L+B, kvh, D]
        v = torch.cat((ctx_v.expand(n, -1, -1, -1), v.unflatten(0, (n, b))), dim=1)
        mask = None if ctx_valid is None else torch.cat((ctx_valid, ctx_valid.new_ones(n, b)), dim=1)  # [N, L+B]
        return self.o_proj(block_attention(q.unflatten(0, (n, r)), k, v, mask).flatten(2))


class BlockDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, qk_norm: bool = False) -> None:
        super().__init__()
        self.self_attn = BlockAttention(config, qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False),
                            current())
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_valid: torch.Tensor | None, rows: slice = slice(None)) -> torch.Tensor:
        """[N, B, H] -> [N, R, H] at the block rows `rows` (every row's keys and values feed them)."""
        x = x[:, rows] + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_valid, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockHead(DraftHead):
    """fc + hidden_norm (the context features), a mask row (learned, or a reserved token's), `num_layers` block
    decoder layers, a final norm; the target's embedding and lm_head shared."""

    def __init__(self, config: MTPHeadConfig) -> None:
        super().__init__(config)
        if config.decoder_type != "llama":
            raise HeadLoadError(f"block heads have Llama decoder layers, not {config.decoder_type!r}")
        if config.block_size < MIN_BLOCK_SIZE or config.num_layers < 1 or not config.aux_layer_ids:
            raise HeadLoadError(f"a block head config needs block_size >= 2, num_layers >= 1 and aux_layer_ids, got "
                                f"{config.block_size}, {config.num_layers}, {config.aux_layer_ids}")
        hidden = config.hidden_size
        decoder_config = config.decoder_config()
        self.fc = nn.Linear(len(config.aux_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        if config.mask_token_id is None:  # no reserved id: a learned row (else the target's frozen row of that id)
            self.mask_embedding = nn.Parameter(torch.zeros(hidden))
        self.layers = nn.ModuleList(BlockDecoderLayer(decoder_config, config.qk_norm) for _ in range(config.num_layers))
        if config.anchor_input:  # zero at the start: the head begins as the one without it
            self.anchor_fc = nn.Linear(2 * hidden, hidden, bias=False)
            nn.init.zeros_(self.anchor_fc.weight)
        self.final_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(decoder_config, self.layers[0].self_attn.head_dim)
        self.target_aux_layers = tuple(i - 1 for i in config.aux_layer_ids)
        self.block_size = config.block_size

    @property
    def layer(self) -> nn.Module:
        """The first layer: DraftHead's cache sizing and attention_dims read its shape (all layers share it)."""
        return self.layers[0]

    # --- context -----------------------------------------------------------------------------------------------
    def features(self, hidden_states: torch.Tensor, aux_hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """aux_hidden_states [T, n, H] (the layers of `target_aux_layers`, in order) -> context features [T, H]."""
        if aux_hidden_states is None:
            raise HeadLoadError(f"a block head reads target layers {self.config.aux_layer_ids}: none were given")
        return self.hidden_norm(self.fc(cast(aux_hidden_states.flatten(1), self.fc.weight.dtype)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """features [T, H] at positions [T] -> per layer [T, 2, kv heads, D]: its rotated keys, then values."""
        cos, sin = self.rotary_emb.half_split(positions)
        return [torch.stack(layer.self_attn.kv(features, cos, sin), dim=1) for layer in self.layers]

    # --- the block ---------------------------------------------------------------------------------------------
    def block_inputs(self, first_ids: torch.Tensor, block_size: int | None = None,
                     anchor_features: torch.Tensor | None = None) -> torch.Tensor:
        """first_ids [N] (each block's pending token) -> [N, B, H]: its embedding, then the mask embedding; with
        `anchor_input` each mask row adds anchor_fc([c_{p-1}; Emb(t_p)]), anchor_features [N, H] being c_{p-1}, the
        context feature of the position before the block (MTP's first-step input: a query that depends on the text
        from the first layer on, where the mask row alone attends by position)."""
        block_size = block_size or self.block_size
        emb = cast(self.shared.embed_tokens(first_ids), self.fc.weight.dtype)  # [N, H]
        mask = self.mask_row().to(emb.dtype)
        masks = mask.expand(emb.shape[0], block_size - 1, -1)
        if self.config.anchor_input:
            if anchor_features is None:
                raise ValueError("this block head reads the anchor (anchor_input): pass anchor_features")
            masks = masks + self.anchor_fc(torch.cat((anchor_features.to(emb.dtype), emb), dim=-1))[:, None]
        return torch.cat((emb[:, None], masks), dim=1)

    def mask_row(self) -> torch.Tensor:
        """[H] the mask rows' input: the learned embedding, or the target's (frozen) row of the reserved id."""
        if self.config.mask_token_id is None:
            return self.mask_embedding
        token = torch.tensor([self.config.mask_token_id], device=self.fc.weight.device)
        return self.shared.embed_tokens(token)[0]

    def block_hidden(self, x: torch.Tensor, positions: torch.Tensor, context: list[torch.Tensor],
                     ctx_valid: torch.Tensor | None, rows: slice = slice(None)) -> torch.Tensor:
        """x [N, B, H] block inputs at positions [N, B]; context: per layer [N or 1, L, 2, kvh, D] (`context_kv`'s
        rows, gathered); ctx_valid [N, L] (None: every block sees all L) -> [N, R, H] the last layer's output (before
        final_norm) at the block rows `rows`: the last layer queries, attends and runs its MLP on those rows alone
        (the same values)."""
        cos, sin = self.rotary_emb.half_split(positions.flatten())
        last = len(self.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, context)):
            x = layer(x, cos, sin, kv[:, :, 0], kv[:, :, 1], ctx_valid, rows if i == last else slice(None))
        return x

    def forward(self, first_ids: torch.Tensor, positions: torch.Tensor, context: list[torch.Tensor],
                ctx_valid: torch.Tensor | None, num_drafts: int | None = None,
                anchor_features: torch.Tensor | None = None) -> torch.Tensor:
        """[N] pending tokens at positions [N, B] -> [N, num_drafts or B-1, V] fp32 logits of the drafts at positions
        1..num_drafts: the last layer's queries, MLP and the lm_head run on the rows a step keeps, not the block.
        anchor_features [N, H]: each block's c_{p-1} (`block_inputs`), for an `anchor_input` head."""
        assert self.shared is not None, "attach() the target's weights first"
        keep = slice(1, 1 + num_drafts) if num_drafts else slice(1, None)
        x = self.block_inputs(first_ids, positions.shape[1], anchor_features)
        x = self.block_hidden(x, positions, context, ctx_valid, keep)
        return self.compute_logits(x)

    # --- KV cache: every layer's context keys/values, one row per slot (page * page_size + offset) ---------------
    def allocate_kv_cache(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> list:
        attn = self.layers[0].self_attn
        return [torch.zeros((num_pages * page_size, 2, attn.num_kv_heads, attn.head_dim), dtype=dtype, device=device)
                for _ in self.layers]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Every layer's context keys/values, and with `anchor_input` the context feature the drafter keeps a slot."""
        features = self.config.hidden_size * dtype.itemsize if self.config.anchor_input else 0
        return len(self.layers) * super().kv_bytes_per_token(dtype) + features

    # --- starting points ---------------------------------------------------------------------------------------
    def init_identity_projection(self) -> None:
        """fc passes the last named layer through: the context starts as that layer's state, normed."""
        hidden = self.config.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, -hidden:] = torch.eye(hidden)

    def load_target_layer(self, layer: dict[str, torch.Tensor]) -> None:
        """Every block layer starts as a target layer (infer's fused qkv_proj split into q/k/v, each key/value head
        repeated where the head has more: the same function); the mask embedding starts at zero (after the input
        norm: a zero row, which attends by position alone)."""
        attn = self.layers[0].self_attn
        q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        qkv = layer["self_attn.qkv_proj.weight"]
        if qkv.shape[0] > q_rows and (qkv.shape[0] - q_rows) % (2 * attn.head_dim) == 0:
            qkv = repeat_kv_heads(qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim, "a block layer")
        if qkv.shape[0] != q_rows + 2 * kv_rows:
            raise HeadLoadError(f"a block layer of {attn.num_heads}/{attn.num_kv_heads} heads cannot start from a "
                                f"target layer with {qkv.shape[0]} q/k/v rows")
        q, k, v = qkv.split((q_rows, kv_rows, kv_rows))
        state = {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v}
        state.update({name: t for name, t in layer.items() if not name.startswith("self_attn.qkv_proj")})
        with torch.no_grad():
            for block_layer in self.layers:
                missing, unexpected = block_layer.load_state_dict(state, strict=False)
                missing = [name for name in missing if not name.endswith(("q_norm.weight", "k_norm.weight"))]
                if missing or unexpected:  # (q/k norms, which a Llama layer lacks, start at ones)
                    raise HeadLoadError(f"a block layer from a target layer: missing {missing[:4]}, unexpected "
                                        f"{unexpected[:4]}")


def init_block_from_target(head: BlockHead, target: nn.Module) -> BlockHead:
    """An untrained block head on an infer Llama target: fc passes the last named layer through, every layer is the
    target's last one, the final norm the target's: a real, weak guess for tests of the machinery."""
    head.init_identity_projection()
    head.load_target_layer(target.model.layers[-1].state_dict())
    with torch.no_grad():
        head.final_norm.weight.copy_(target.model.norm.weight)
    return head
