"""A tiny Llama model with fixed random weights, written by ``transformers`` (nothing is
downloaded): what the real-vLLM tests serve.

The tokenizer is byte-level (one token per byte, no merges) with a chat template, so
``vllm serve`` answers ``/v1/completions`` and ``/v1/chat/completions`` for any text. The
weights come from a seeded generator: every run, every process writes the same model, so
a reference engine and a prefill/decode pair compute the same logits.

``python tiny_model.py DIR [SLIDING_WINDOW]`` writes it (idempotent: a complete ``DIR`` is
left alone); with a window, every layer is sliding-window attention of that many tokens
(``layer_types``, which vLLM's Llama reads).
"""

from __future__ import annotations

import json
import os
import sys

SPECIALS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# head_dim 32: the smallest head size vLLM's CPU attention backend supports.
CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def make_tiny_model(path: str, seed: int = 1234, sliding_window: int = 0) -> str:
    """Writes the model and tokenizer to ``path`` (once) and returns ``path``."""
    stamp = os.path.join(path, ".complete")
    if os.path.exists(stamp):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    window = (
        dict(layer_types=["sliding_attention"] * CONFIG["num_hidden_layers"], sliding_window=sliding_window)
        if sliding_window
        else {}
    )
    config = LlamaConfig(
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        **CONFIG,
        **window,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # Larger logits than the default init: sampled tokens depend on the KV cache
        # clearly (a control with other KV must disagree), still deterministic per seed.
        model.lm_head.weight.mul_(8.0)
        # </s> is never the likeliest token: generations run to max_tokens.
        model.lm_head.weight[vocab["</s>"]].zero_()
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"]}, f)
    open(stamp, "w").close()
    return path


if __name__ == "__main__":
    print(make_tiny_model(sys.argv[1], sliding_window=int(sys.argv[2]) if len(sys.argv) > 2 else 0))
