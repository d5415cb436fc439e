"""Export the SmolLM2 GGUF that Kiln serves as a Hugging Face model directory.

Peers that load only HF directories (vLLM) get the very weights Kiln runs:
Kiln's GGUF loader dequantizes every tensor to float32 under its HF Llama
name; this writes them as model.safetensors (float32; pass --dtype to store
another) with a LlamaConfig, generation_config.json and the tokenizer
(transformers' GGUF tokenizer support, through kiln.llm.tokenizer, chat
template included).

Run with Kiln's venv (it only reads kiln; nothing is installed):

    .venv/bin/python bench/peers/export_hf.py [--gguf PATH] [--out bench/peers/envs/smollm2-hf]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.llm.models.default_model import default_model_path
from kiln.llm.models.loader import load_checkpoint
from kiln.llm.tokenizer import load_tokenizer


def export(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    ckpt = load_checkpoint(gguf)
    a = ckpt.arch
    tok = load_tokenizer(ckpt.tokenizer_path)
    out.mkdir(parents=True, exist_ok=True)
    eos = list(a.eos_token_ids) or ([tok.hf.eos_token_id] if tok.hf.eos_token_id is not None else [])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": a.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": a.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "initializer_range": 0.02,
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": a.bos_token_id, "eos_token_id": config["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    # Tied embeddings: lm_head is absent from the GGUF and from this file.
    tensors = {k: v.to(dtype).contiguous() for k, v in ckpt.dequantized_weights().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": str(gguf)})
    hf_tok = tok.hf
    if tok.chat_template and not hf_tok.chat_template:
        hf_tok.chat_template = tok.chat_template
    hf_tok.save_pretrained(str(out))
    # Older transformers keep the template only in chat_template.jinja; vLLM
    # and AutoTokenizer read either, but make sure tokenizer_config has it.
    cfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text())
    if tok.chat_template and not tcfg.get("chat_template"):
        tcfg["chat_template"] = tok.chat_template
        cfg_path.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
    n = sum(t.numel() for t in tensors.values())
    print(f"wrote {out}: {len(tensors)} tensors, {n / 1e6:.1f}M params, {dtype}; "
          f"vocab {a.vocab_size}, chat template {'yes' if tok.chat_template else 'NO'}")


def check(gguf: Path, out: Path) -> None:
    """Reload the export with plain transformers; compare tokens and logits with Kiln's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = load_tokenizer(gguf)
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "def f(x):\n    return x * 2  # Hello, world! Ünïcödé"
    assert tok.encode(text) == ref.encode(text), "tokenizer mismatch with the GGUF tokenizer"
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == ref.render_chat(msgs)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from offline_throughput import hf_model_from_checkpoint

    base = hf_model_from_checkpoint(str(gguf), torch.float32)
    ids = torch.tensor([ref.encode(text)])
    with torch.inference_mode():
        diff = (model(ids).logits - base(ids).logits).abs().max().item()
    assert diff < 1e-4, f"logits differ by {diff}"
    print(f"check ok: tokenizer and chat template match, max |logit diff| = {diff:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the installed SmolLM2 Q4_1)")
    ap.add_argument("--out", default="bench/peers/envs/smollm2-hf")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--no-check", action="store_true", help="skip the reload-and-compare check")
    args = ap.parse_args()
    gguf = Path(args.gguf) if args.gguf else default_model_path()
    export(gguf, Path(args.out), getattr(torch, args.dtype))
    if not args.no_check:
        check(gguf, Path(args.out))


if __name__ == "__main__":
    main()
