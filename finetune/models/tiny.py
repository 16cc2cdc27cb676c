"""The tiny-model path: real-format Llama 3.2 and GPT-OSS stand-ins small enough to train on a CPU with no hub.

The tokenizers are 1000-token byte-level BPEs trained by `scripts/build_tiny_assets.py` and checked in under
`tiny_tokenizers/`. They carry each family's real special tokens, bos/eos/pad roles and chat template, so the
recipes' chat formatting, loss masking and stopping behave as they would with the hub checkpoints. What each family's
stand-in is (its tokens' roles, its architecture scaled down) is its entry in finetune/families.py; this module builds.
"""

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from finetune import patches
from finetune.errors import UserError
from finetune.families import FAMILIES, TINY_WIDTH, load_architecture, trl_chat_template

TINY_TOKENIZERS_DIR = Path(__file__).parent.parent / "tiny_tokenizers"


TINY_MODEL_SEED = 0


def build_tiny_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The tiny tokenizer of a model family (finetune/families.py), set up like that family's hub tokenizer."""
    tiny = FAMILIES[family].tiny
    return PreTrainedTokenizerFast(
        tokenizer_file=str(TINY_TOKENIZERS_DIR / family / "tokenizer.json"),
        bos_token=tiny.bos_token,
        eos_token=tiny.eos_token,
        pad_token=tiny.pad_token,
        chat_template=trl_chat_template(FAMILIES[family]),
    )


def check_width(family: str, width: int, source: str) -> None:
    """`--tiny_width`, refused before the tiny model is built (transformers fails on it with a traceback): each
    attention head takes an even share of the width, since rotary embeddings rotate pairs of its values."""
    step = 2 * FAMILIES[family].tiny.scaled_down["num_attention_heads"]
    if width < step or width % step:
        raise UserError(f"{source}: `tiny_width: {width}` is no width the tiny {family} model can have (its "
                        f"{step // 2} attention heads each take an even share); give a multiple of {step} such as "
                        f"{TINY_WIDTH} or {2 * TINY_WIDTH} (a recipe key or --tiny_width).")


def tiny_config(family: str, tokenizer: PreTrainedTokenizerFast, width: int = TINY_WIDTH):
    """The family's scaled-down config; `width` (the hidden size) scales the MLP and the heads' width with it."""
    tiny = FAMILIES[family].tiny
    config = load_architecture(tiny.architecture)
    for key, value in tiny.scaled_down.items():
        setattr(config, key, value)
    if width != tiny.scaled_down["hidden_size"]:
        config.hidden_size = width
        config.intermediate_size = tiny.scaled_down["intermediate_size"] * width // tiny.scaled_down["hidden_size"]
        config.head_dim = width // tiny.scaled_down["num_attention_heads"]
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
