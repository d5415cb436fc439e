"""Writers of pre-quantized checkpoints for the format tests, from a float
model, following each format's documented layout -- written here, not with
Kiln's readers, so the tests check Kiln against the layouts themselves.

Each int4 writer quantizes round-to-nearest and returns, next to the stored
tensors, the reference dequantization computed from its own codes in
float64 (exact: every value is an fp16 scale times a small integer).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass
class Quantized:
    q: torch.Tensor  # int64 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, groups] (fp16 values)
    zero: torch.Tensor  # int64 [N, groups]
    g_idx: torch.Tensor  # int64 [K]: group of each input feature

    def reference(self) -> torch.Tensor:
        """(q - z) * s per input feature's group, in float64, as float32."""
        s = self.scale.double()[:, self.g_idx]
        z = self.zero[:, self.g_idx]
        return ((self.q - z).double() * s).float()


def rtn_int4(w: torch.Tensor, group: int, sym: bool, perm: torch.Tensor | None = None, min_zero: int = 0) -> Quantized:
    """Round-to-nearest 4-bit with groups of `group` input features, taken in
    the order `perm` (act-order) or plainly; GPTQ's sym convention is z = 8."""
    n, k = w.shape
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    cols = w.double()[:, order].reshape(n, k // group, group)
    lo, hi = cols.amin(-1), cols.amax(-1)
    if sym:
        amax = torch.maximum(lo.abs(), hi)
        scale = (2 * amax / 15).clamp(min=1e-5).half().double()
        zero = torch.full_like(scale, 8, dtype=torch.int64)
    else:
        scale = ((hi - lo) / 15).clamp(min=1e-5).half().double()
        zero = torch.round(-lo / scale).clamp(min_zero, 15).to(torch.int64)
    q_sorted = torch.round(cols / scale[..., None]) + zero[..., None]
    q = torch.empty(n, k, dtype=torch.int64)
    q[:, order] = q_sorted.clamp(0, 15).to(torch.int64).reshape(n, k)
    return Quantized(q, scale.float(), zero, g_idx)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_gptq(qz: Quantized, zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """AutoGPTQ layout: qweight [K/8, N] along the input, qzeros [G, N/8] along the output (z - offset)."""
    q_t = qz.q.t()  # [K, N]
    k, n = q_t.shape
    shifts = (4 * torch.arange(8)).view(1, 8, 1)
    qweight = (q_t.reshape(k // 8, 8, n) << shifts).sum(1)
    stored = (qz.zero.t() - zero_offset) & 0xF  # [G, N]
    qzeros = (stored.reshape(stored.shape[0], n // 8, 8) << (4 * torch.arange(8))).sum(-1)
    return {
        "qweight": _as_int32(qweight), "qzeros": _as_int32(qzeros),
        "scales": qz.scale.t().contiguous().half(), "g_idx": qz.g_idx.to(torch.int32),
    }


def pack_awq(qz: Quantized) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM layout: qweight [K, N/8], qzeros [G, N/8], both along the output in AWQ_ORDER."""
    def pack(values: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        r, n = values.shape
        groups = values.reshape(r, n // 8, 8)
        words = torch.zeros(r, n // 8, dtype=torch.int64)
        for i, col in enumerate(AWQ_ORDER):
            words |= groups[:, :, col] << (4 * i)
        return _as_int32(words)

    return {"qweight": pack(qz.q.t()), "qzeros": pack(qz.zero.t()), "scales": qz.scale.t().contiguous().half()}


def write_hf_dir(dst: Path, base: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> Path:
    """`base`'s config, tokenizer and files, with `tensors` as its weights and a quantization_config."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def is_projection(name: str) -> bool:
    return any(f".{p}.weight" in name for p in PROJECTIONS)


# --- GGUF ----------------------------------------------------------------

QK_K = 256


def q4_k_blocks(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> Q4_K bytes [rows, cols/256*144] (ggml-common.h's block_q4_K), round to nearest."""
    rows, cols = w.shape
    sub = w.astype(np.float64).reshape(rows, cols // QK_K, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
    scale, mins = (hi - lo) / 15, -lo  # per sub-block, both >= 0
    d = np.maximum(scale.max(-1) / 63, 2**-14).astype(np.float16)  # fp16 normals
    dmin = np.maximum(mins.max(-1) / 63, 2**-14).astype(np.float16)
    sc = np.clip(np.round(scale / d[..., None].astype(np.float64)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dmin[..., None].astype(np.float64)), 0, 63).astype(np.uint8)
    eff_scale = d[..., None].astype(np.float64) * sc
    eff_min = dmin[..., None].astype(np.float64) * m
    q = np.clip(np.round((sub + eff_min[..., None]) / eff_scale[..., None]), 0, 15).astype(np.uint8)
    packed = np.zeros((rows, cols // QK_K, 12), dtype=np.uint8)  # inverse of get_scale_min_k4
    packed[..., 0:4] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    pairs = q.reshape(rows, cols // QK_K, 4, 2, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, cols // QK_K, 128)
    blocks = np.concatenate([
        d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, qs,
    ], axis=-1)
    return blocks.reshape(rows, -1)


def q6_k_blocks(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> Q6_K bytes [rows, cols/256*210] (block_q6_K: ql, qh, int8 scales, fp16 d)."""
    rows, cols = w.shape
    nb = cols // QK_K
    sub = w.astype(np.float64).reshape(rows, nb, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = np.maximum(scale.max(-1) / 127, 2**-14).astype(np.float16)
    sc = np.clip(np.round(scale / d[..., None].astype(np.float64)), 1, 127).astype(np.int8)
    eff = d[..., None].astype(np.float64) * sc
    q = (np.clip(np.round(sub / eff[..., None]), -32, 31) + 32).astype(np.uint8).reshape(rows, nb, 256)
    # element h*128 + s*64 + i: low nibble in byte h*64 + i (s = 0) or its high nibble (s = 1)
    low = (q & 0x0F).reshape(rows, nb, 2, 2, 64)
    ql = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(rows, nb, 128)
    # element h*128 + t*32 + i: top 2 bits in bits 2t of byte h*32 + i
    high = (q >> 4).reshape(rows, nb, 2, 4, 32)
    qh = (high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6))
    blocks = np.concatenate([ql, qh.reshape(rows, nb, 64), sc.view(np.uint8), d[..., None].view(np.uint8)], axis=-1)
    return blocks.reshape(rows, -1)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(rest[:-1])]}.weight"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K row permutation."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return q4_k_blocks(w)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return q6_k_blocks(w)
    if qtype == gguf.GGMLQuantizationType.Q8_1:  # no reader anywhere: bytes of the right size, all zero
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
    return gguf.quants.quantize(w, qtype)


def write_gguf(path: Path, state: dict[str, torch.Tensor], config, types: dict[str, gguf.GGMLQuantizationType]) -> Path:
    """A llama GGUF of `state` (HF names, float32); `types` maps a HF name
    suffix (e.g. "self_attn.q_proj.weight") to its stored type (default F32)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        w = tensor.numpy().astype(np.float32)
        if "q_proj" in name:
            w = llama_cpp_permute(w, config.num_attention_heads)
        elif "k_proj" in name:
            w = llama_cpp_permute(w, config.num_key_value_heads)
        qtype = next((t for suffix, t in types.items() if name.endswith(suffix)), gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), w)
        else:
            writer.add_tensor(gguf_name(name), encode(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
