"""Convert a llama2.c v0 checkpoint and tokenizer into a Hugging Face Llama folder.

The output (config.json, generation_config.json, model.safetensors, tokenizer files) loads with
`LlamaForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`, so llama2.c's tinyllamas
can serve as real targets for the project's draft heads and runtime.

Two llama2.c quirks shape the conversion:
- llama2.c rotates interleaved (even, odd) pairs of each q/k head; HF Llama rotates the first half
  against the second, so q_proj/k_proj rows are permuted per head.
- llama2.c's encoder is not sentencepiece's: it keeps runs of spaces and merges, at every step, the
  adjacent pair whose concatenation has the highest vocab score. The tokenizer is rebuilt from the
  llama2.c vocab so that it encodes exactly the same way (see `build_tokenizer`).

Usage:
    python -m data_tools.convert_llama2c --checkpoint stories260K.bin --tokenizer tok512.bin --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

HEADER = struct.Struct("<7i")
V1_MAGIC = 0x616B3432  # "ak42": llama2.c's versioned export formats, which this converter does not read
N_SPECIAL = 3  # <unk>, <s>, </s>
N_BYTES = 256  # <0x00>..<0xFF>, ids 3..258: llama2.c's byte fallback is id = byte + 3
BOS_ID, EOS_ID = 1, 2
ROPE_THETA = 10000.0  # what llama2.c's model.py uses; checked against the stored freq_cis tables
SPACE_MARK = "\u2581"  # sentencepiece's "▁"; llama2.c's export replaced it with a real space


class ConversionError(Exception):
    """A problem with the user's inputs; `main` prints it as one line and exits with code 2."""


@dataclass(frozen=True)
class Llama2cConfig:
    """The v0 header, with the sign of vocab_size decoded into `shared_classifier`."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The fp32 arrays after the header, in file order (llama2.c export.py `legacy_export`)."""
        n, d, h, kv = self.n_layers, self.dim, self.hidden_dim, self.kv_dim
        shapes = [
            ("token_embedding", (self.vocab_size, d)),
            ("rms_att", (n, d)),
            ("wq", (n, d, d)),
            ("wk", (n, kv, d)),
            ("wv", (n, kv, d)),
            ("wo", (n, d, d)),
            ("rms_ffn", (n, d)),
            ("w1", (n, h, d)),
            ("w2", (n, d, h)),
            ("w3", (n, h, d)),
            ("rms_final", (d,)),
            ("freq_cis_real", (self.seq_len, self.head_dim // 2)),
            ("freq_cis_imag", (self.seq_len, self.head_dim // 2)),
        ]
        if not self.shared_classifier:
            shapes.append(("wcls", (self.vocab_size, d)))
        return shapes


def parse_header(path: Path, data: bytearray) -> Llama2cConfig:
    """Decode and sanity-check the 7-int32 header, so a wrong file fails here rather than as a reshape error."""
    if len(data) < HEADER.size:
        raise ConversionError(f"--checkpoint {path}: {len(data)} bytes, too short for a llama2.c header")
    fields = HEADER.unpack_from(data)
    if fields[0] == V1_MAGIC:
        raise ConversionError(
            f"--checkpoint {path}: llama2.c versioned export (magic 'ak42'); only the legacy v0 format is supported"
        )
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, signed_vocab, seq_len = fields
    cfg = Llama2cConfig(dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(signed_vocab), seq_len, signed_vocab > 0)
    if min(dim, hidden_dim, n_layers, n_heads, n_kv_heads, cfg.vocab_size, seq_len) <= 0:
        raise ConversionError(f"--checkpoint {path}: not a llama2.c v0 checkpoint (header {fields})")
    if dim % n_heads or n_heads % n_kv_heads or cfg.head_dim % 2:
        raise ConversionError(
            f"--checkpoint {path}: inconsistent header (dim {dim}, n_heads {n_heads}, n_kv_heads {n_kv_heads})"
        )
    return cfg


def read_checkpoint(path: Path) -> tuple[Llama2cConfig, dict[str, torch.Tensor]]:
    """Read a v0 checkpoint into its config and the raw llama2.c arrays, checking the file size exactly."""
    data = bytearray(path.read_bytes())  # writable, so torch.frombuffer shares it without a warning
    cfg = parse_header(path, data)
    shapes = cfg.tensor_shapes()
    n_floats = sum(torch.Size(shape).numel() for _, shape in shapes)
    expected = HEADER.size + 4 * n_floats
    if len(data) != expected:
        raise ConversionError(
            f"--checkpoint {path}: {len(data)} bytes, but its header {tuple(HEADER.unpack_from(data))} "
            f"implies {expected} (truncated, or not a llama2.c v0 file)"
        )
    flat = torch.frombuffer(data, dtype=torch.float32, offset=HEADER.size)
    arrays, offset = {}, 0
    for name, shape in shapes:
        numel = torch.Size(shape).numel()
        arrays[name] = flat[offset : offset + numel].view(shape)
        offset += numel
    return cfg, arrays


def check_rope_theta(path: Path, cfg: Llama2cConfig, arrays: dict[str, torch.Tensor]) -> None:
    """HF recomputes RoPE from rope_theta, so the freq_cis tables the file carries must agree with it."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), inv_freq)  # (seq_len, head_dim/2)
    for name, table in (("freq_cis_real", angles.cos()), ("freq_cis_imag", angles.sin())):
        if not torch.allclose(arrays[name].double(), table, rtol=0.0, atol=1e-4):
            raise ConversionError(f"--checkpoint {path}: {name} is not RoPE with theta {ROPE_THETA:g}")


def interleaved_to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows per head: llama2.c rotates pairs (x0, y0, x1, y1, ...), HF (x0, x1, ..., y0, y1, ...)."""
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return w.view(n_heads, head_dim // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def to_hf_state_dict(cfg: Llama2cConfig, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename to LlamaForCausalLM keys; freq_cis is dropped (HF recomputes RoPE from rope_theta)."""
    state = {"model.embed_tokens.weight": arrays["token_embedding"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = arrays["rms_att"][i]
        state[p + "self_attn.q_proj.weight"] = interleaved_to_half_split(arrays["wq"][i], cfg.n_heads)
        state[p + "self_attn.k_proj.weight"] = interleaved_to_half_split(arrays["wk"][i], cfg.n_kv_heads)
        state[p + "self_attn.v_proj.weight"] = arrays["wv"][i]
        state[p + "self_attn.o_proj.weight"] = arrays["wo"][i]
        state[p + "post_attention_layernorm.weight"] = arrays["rms_ffn"][i]
        state[p + "mlp.gate_proj.weight"] = arrays["w1"][i]
        state[p + "mlp.down_proj.weight"] = arrays["w2"][i]
        state[p + "mlp.up_proj.weight"] = arrays["w3"][i]
    state["model.norm.weight"] = arrays["rms_final"]
    if not cfg.shared_classifier:
        state["lm_head.weight"] = arrays["wcls"]
    return {name: t.clone() for name, t in state.items()}  # own storage: safetensors rejects shared buffers


def hf_config(cfg: Llama2cConfig) -> dict[str, object]:
    """LlamaConfig as a dict, plus the v4-style `rope_theta`/`torch_dtype` keys for readers that parse the JSON."""
    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=cfg.shared_classifier,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    ).to_dict()
    return config | {"rope_theta": ROPE_THETA, "torch_dtype": "float32"}


def read_vocab(path: Path, vocab_size: int) -> list[tuple[str, float]]:
    """Read tokenizer.bin (int32 max_token_length, then per token: f32 score, int32 length, bytes).

    The file does not store its size; llama2.c reads `vocab_size` entries from the checkpoint's header,
    so a mismatch would silently shift every id. It is checked here against the whole file instead.
    """
    data = path.read_bytes()
    pieces, offset = [], 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise ConversionError(f"--tokenizer {path}: truncated after {len(pieces)} tokens")
        score, length = struct.unpack_from("<fi", data, offset)
        raw = data[offset + 8 : offset + 8 + length]
        if length < 0 or len(raw) != length:
            raise ConversionError(f"--tokenizer {path}: truncated or corrupt at token {len(pieces)}")
        try:
            pieces.append((raw.decode("utf-8"), score))
        except UnicodeDecodeError:
            raise ConversionError(f"--tokenizer {path}: token {len(pieces)} is not UTF-8") from None
        offset += 8 + length
    if len(pieces) != vocab_size:
        raise ConversionError(f"--tokenizer {path}: {len(pieces)} tokens, but --checkpoint has vocab_size {vocab_size}")
    byte_pieces = [piece for piece, _ in pieces[N_SPECIAL : N_SPECIAL + N_BYTES]]
    if byte_pieces != [f"<0x{b:02X}>" for b in range(N_BYTES)]:
        raise ConversionError(f"--tokenizer {path}: ids 3..258 are not the byte tokens <0x00>..<0xFF>")
    return pieces


def bpe_merges(pieces: list[tuple[str, float]]) -> list[tuple[str, str]]:
    """Every split of a learned piece into two learned pieces, ranked by the score of the piece they form.

    llama2.c merges the adjacent pair whose *concatenation* scores highest, whichever split produced it;
    HF BPE merges the pair of lowest rank. Ranking all splits by their result's score makes both pick the
    same string at every step. Distinct strings with equal scores would need llama2.c's leftmost tie-break,
    which a merge list cannot express, so they are rejected.
    """
    learned = {piece: score for piece, score in pieces[N_SPECIAL + N_BYTES :]}
    ranked = []  # (-score of result, result, cut position, left, right)
    for piece, score in learned.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in learned and right in learned:
                ranked.append((-score, piece, cut, left, right))
    result_scores = {piece: score for score, piece, *_ in ranked}
    if len(set(result_scores.values())) != len(result_scores):
        raise ValueError("two mergeable pieces share a score; llama2.c's leftmost tie-break is not expressible")
    return [(left, right) for *_, left, right in sorted(ranked)]


def build_tokenizer(pieces: list[tuple[str, float]], model_max_length: int) -> PreTrainedTokenizerFast:
    """A byte-fallback BPE that encodes like llama2.c's `encode(text, bos=1, eos=0)`.

    The normalizer reproduces llama2.c's dummy-prefix space and keeps every space (mapped to "▁", the
    sentencepiece convention the vocab was exported from); there is no pre-tokenizer, so merges run over
    the whole text as llama2.c's do. Special tokens written in the text stay text, as in llama2.c.
    """
    names = ["<unk>", "<s>", "</s>"] + [p.replace(" ", SPACE_MARK) for p, _ in pieces[N_SPECIAL:]]
    if len(set(names)) != len(names):
        raise ValueError("two pieces collide once spaces are written as '\u2581'")
    vocab = {name: i for i, name in enumerate(names)}
    merges = [(a.replace(" ", SPACE_MARK), b.replace(" ", SPACE_MARK)) for a, b in bpe_merges(pieces)]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), normalizers.Replace(" ", SPACE_MARK)])
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names[:N_SPECIAL]])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
        model_max_length=model_max_length,
    )


def load_tokenizer(path: Path, vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """read_vocab + build_tokenizer, with a vocab that cannot be rebuilt reported against its file."""
    pieces = read_vocab(path, vocab_size)
    try:
        return build_tokenizer(pieces, model_max_length)
    except ValueError as err:
        raise ConversionError(f"--tokenizer {path}: {err}") from None


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """save_pretrained, then name the class and BOS policy the way transformers 4.x also understands.

    transformers 5 writes "TokenizersBackend" (unknown to 4.x) and drops add_bos_token, relying on the
    post-processor in tokenizer.json; both versions keep using that post-processor.
    """
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_folder(
    folder: Path, cfg: Llama2cConfig, state: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerFast, source: Path
) -> None:
    """Write every output file into `folder`, the staging dir that is then renamed into place."""
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=2, sort_keys=True) + "\n")
    # Stories end with BOS: the model emits 1 between stories and never 2, so 1 is the stop token.
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=BOS_ID, do_sample=False).save_pretrained(folder)
    metadata = {"format": "pt", "source": f"llama2.c v0: {source.name}", "source_sha256": file_sha256(source)}
    save_file(state, str(folder / "model.safetensors"), metadata=metadata)
    save_tokenizer(tokenizer, folder)
    # mkdtemp makes the dir 0700 and safetensors writes 0600; the result should read like any model folder.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def check_inputs(checkpoint: Path, tokenizer: Path, out: Path, force: bool) -> None:
    """Fail before any work on the mistakes a user can see from the command line."""
    for flag, path in (("--checkpoint", checkpoint), ("--tokenizer", tokenizer)):
        if not path.is_file():
            raise ConversionError(f"{flag} {path}: no such file")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConversionError(f"--out {out}: directory is not empty (pass --force to replace it)")


def move_into_place(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`. An old `out` is first renamed aside and deleted only once the new one is in
    place, so `out` is always either the old folder or the complete new one (bar a crash between two renames)."""
    if not out.exists():
        os.rename(staging, out)
        return
    retired = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.rename(out, retired / out.name)
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(retired / out.name, out)  # put the old folder back
        retired.rmdir()
        raise
    shutil.rmtree(retired)


def convert_llama2c(checkpoint: Path, tokenizer: Path, out: Path, force: bool = False) -> Path:
    """Convert and write the HF folder at `out` atomically; returns `out`. Raises ConversionError on bad inputs."""
    checkpoint, tokenizer, out = Path(checkpoint), Path(tokenizer), Path(out)
    check_inputs(checkpoint, tokenizer, out, force)
    cfg, arrays = read_checkpoint(checkpoint)
    check_rope_theta(checkpoint, cfg, arrays)
    hf_tokenizer = load_tokenizer(tokenizer, cfg.vocab_size, cfg.seq_len)
    state = to_hf_state_dict(cfg, arrays)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        write_folder(staging, cfg, state, hf_tokenizer, checkpoint)
        move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_tools.convert_llama2c",
        description="Convert a llama2.c v0 checkpoint and tokenizer.bin into a Hugging Face LlamaForCausalLM folder.",
    )
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="llama2.c v0 checkpoint (.bin): 7 int32 header then fp32 weights, e.g. stories260K.bin")
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="llama2.c tokenizer (.bin) with one entry per checkpoint vocab id, e.g. tok512.bin")
    parser.add_argument("--out", type=Path, required=True,
                        help="output folder; written to a temp dir beside it, then renamed into place")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0 on success, 2 (with one line on stderr) on a bad input."""
    args = build_parser().parse_args(argv)
    try:
        out = convert_llama2c(args.checkpoint, args.tokenizer, args.out, force=args.force)
    except ConversionError as err:
        print(f"convert_llama2c: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"convert_llama2c: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
