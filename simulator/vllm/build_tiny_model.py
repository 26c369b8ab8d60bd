"""Build the tiny random-weight Llama that the real-vLLM tier serves. Standalone: runs with
the vLLM environment's Python (``.venv-vllm``), which has torch and transformers but not epp.

    .venv-vllm/bin/python simulator/vllm/build_tiny_model.py LITELLM_WHEEL OUT_DIR

No model can be downloaded on these machines. The tokenizer is a real one: DeepSeek-V3's BPE
tokenizer (MIT licensed, its LICENSE copied beside it), shipped inside the ``litellm`` wheel
from PyPI. The model is a 2-layer Llama (hidden 128, 4 heads of 32: the CPU attention wants
head sizes like 32/64/128), fp32, random weights from a fixed seed, ~70 MB. Its output is
gibberish; its prefix caching, metrics and KV-cache events are vLLM's own.
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

TOKENIZER = "litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json"
LICENSE = "litellm/litellm_core_utils/tokenizers/deepseek_tokenizer_LICENSE"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% set c = m['content'] if m['content'] is string else "
    "(m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) %}"
    "{% if m['role'] == 'system' %}{{ c }}\n\n"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ c }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ c }}<｜end▁of▁sentence｜>"
    "{% else %}{{ c }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def write_tokenizer(wheel: str, out_dir: str) -> int:
    """The tokenizer files (tokenizer.json, tokenizer_config.json with the chat template,
    the licence) into ``out_dir``; returns the vocabulary size. Needs no torch: the emulated
    stack's precise mode uses it alone."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        tokenizer = json.loads(z.read(TOKENIZER))
        (out / "tokenizer.json").write_bytes(z.read(TOKENIZER))
        (out / "LICENSE-tokenizer").write_bytes(z.read(LICENSE))
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]
    vocab = int(max(ids)) + 1
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1, ensure_ascii=False))
    return vocab


def main(wheel: str, out_dir: str) -> None:
    out = Path(out_dir)
    vocab = write_tokenizer(wheel, out_dir)
    tokenizer = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=tokenizer["added_tokens"][0]["id"], eos_token_id=tokenizer["added_tokens"][1]["id"],
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny model ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"vocabulary {vocab}) in {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
