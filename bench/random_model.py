"""A randomly initialised copy of a model: its config and tokenizer, fresh weights. Same shapes
and FLOPs, no weights to carry, so timings can be taken on a machine that can't download.

    python bench/random_model.py ~/.cache/plait/models/SmolLM2-135M-Instruct /tmp/random-smollm2
"""

import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.gguf"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
    model.save_pretrained(dst)
    print(f"random model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {dst}")
