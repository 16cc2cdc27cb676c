"""The tiny-model path: real-format Llama 3.2 and GPT-OSS stand-ins small enough to train on a CPU with no hub.

The tokenizers are 1000-token byte-level BPEs trained by `scripts/build_tiny_assets.py` and checked in under
`tiny_tokenizers/`. They carry each family's real special tokens, bos/eos/pad roles and chat template, so the
recipes' chat formatting, loss masking and stopping behave as they would with the hub checkpoints.
"""

from pathlib import Path

import trl
from transformers import PreTrainedTokenizerFast

from finetune import patches

TINY_TOKENIZERS_DIR = Path(__file__).parent / "tiny_tokenizers"
TRL_CHAT_TEMPLATES_DIR = Path(trl.__file__).parent / "chat_templates"

# The roles the hub checkpoints give their special tokens (meta-llama/Llama-3.2-*-Instruct and openai/gpt-oss-*),
# and the TRL copy of each family's chat template. TRL's template is used rather than a copy of our own so that
# trl's template recognition (get_training_chat_template) sees the exact string it compares against.
_TINY_TOKENIZER_SPECS = {
    "llama": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|finetune_right_pad_id|>",
        "chat_template": "llama3_2.jinja",
    },
    "gpt-oss": {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "chat_template": "gptoss.jinja",
    },
}


def build_tiny_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The tiny tokenizer of a model family ("llama" or "gpt-oss"), set up like that family's hub tokenizer."""
    if family not in _TINY_TOKENIZER_SPECS:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {sorted(_TINY_TOKENIZER_SPECS)}")
    spec = _TINY_TOKENIZER_SPECS[family]
    return PreTrainedTokenizerFast(
        tokenizer_file=str(TINY_TOKENIZERS_DIR / family / "tokenizer.json"),
        bos_token=spec["bos_token"],
        eos_token=spec["eos_token"],
        pad_token=spec["pad_token"],
        chat_template=(TRL_CHAT_TEMPLATES_DIR / spec["chat_template"]).read_text(encoding="utf-8"),
    )


TINY_WIDTH = 64  # every family's hidden size below: the tests' width; --tiny_width scales a family from it

# Scaled-down copies of the real configs: the same attention layout (GQA; GPT-OSS's sinks and alternating sliding
# and full layers), the same kind of MLP (GPT-OSS: 4 experts, top-2 routing) and Llama's tied embeddings.
_TINY_ARCHITECTURE = {
    "llama": (
        "llama-3.2-1b",
        {"hidden_size": TINY_WIDTH, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16},
    ),
    "gpt-oss": (
        "gpt-oss-20b",
        {"hidden_size": TINY_WIDTH, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
         "experts_per_token": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16},
    ),
}
TINY_MODEL_SEED = 0


def tiny_config(family: str, tokenizer: PreTrainedTokenizerFast, width: int = TINY_WIDTH):
    """The family's scaled-down config; `width` (the hidden size) scales the MLP and the heads' width with it."""
    from finetune.architectures import load_architecture

    architecture, scaled_down = _TINY_ARCHITECTURE[family]
    config = load_architecture(architecture)
    for key, value in scaled_down.items():
        setattr(config, key, value)
    if width != scaled_down["hidden_size"]:
        config.hidden_size = width
        config.intermediate_size = scaled_down["intermediate_size"] * width // scaled_down["hidden_size"]
        config.head_dim = width // scaled_down["num_attention_heads"]
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    return config


def tiny_model_folder(family: str, width: int = TINY_WIDTH) -> Path:
    """A folder holding the tiny model and tokenizer of a family, built once per version and reused.

    Every process of a launch asks for it; the build is seeded and written aside then renamed into place, so
    concurrent builders agree on the weights and never see a half-written folder.
    """
    import hashlib
    import os
    import tempfile

    import safetensors.torch
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tiny_tokenizer(family)
    config = tiny_config(family, tokenizer, width)
    # the tokenizer file is part of the key: a rebuilt tokenizer of the same size must not reuse an older folder
    vocabulary = (TINY_TOKENIZERS_DIR / family / "tokenizer.json").read_text(encoding="utf-8")
    identity = f"{config.to_json_string()}{vocabulary}{transformers.__version__}{TINY_MODEL_SEED}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("FINETUNE_TINY_CACHE", Path.home() / ".cache" / "finetune" / "tiny"))
    folder = cache / f"{family}-{key}"
    if (folder / "config.json").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{family}-"))
    torch.manual_seed(TINY_MODEL_SEED)
    with patches.zero3_init_off():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    # Every process writes its own complete copy: save_pretrained writes nothing on ranks other than 0 once a process
    # group exists, and on several nodes each node needs the folder in its own cache.
    model.config.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    safetensors.torch.save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process finished first; its folder is identical
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return folder


def tiny_mxfp4_folder() -> Path:
    """The tiny GPT-OSS written as the hub ships openai/gpt-oss-*: experts in MXFP4 (blocks and scales), every other
    tensor in bf16, sharded with an index, `quantization_config: {quant_method: mxfp4}` in config.json."""
    import shutil
    import tempfile

    import safetensors.torch
    from transformers import AutoConfig

    from finetune import mxfp4

    source = tiny_model_folder("gpt-oss")
    folder = source.parent / f"{source.name}-mxfp4"
    if (folder / "config.json").is_file():
        return folder
    staging = Path(tempfile.mkdtemp(dir=source.parent, prefix=f".{folder.name}-"))
    tensors = safetensors.torch.load_file(str(source / "model.safetensors"))
    mxfp4.write_checkpoint(AutoConfig.from_pretrained(source), sorted(tensors.items()), staging)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, staging / name)
    try:
        staging.rename(folder)
    except OSError:  # another process finished first; its folder is identical
        shutil.rmtree(staging, ignore_errors=True)
    return folder
