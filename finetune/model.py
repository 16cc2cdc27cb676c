"""Tokenizer, model and LoRA config for a run: a hub id, a local folder, or (with --tiny) a tiny random model of the
recipe's family written to a local folder, so that all three load through the same `from_pretrained` call.
"""

import logging
import warnings
from pathlib import Path

import torch
from accelerate import PartialState
from peft import LoraConfig
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Mxfp4Config,
                          PreTrainedModel)
from trl import get_peft_config, get_quantization_config

from finetune import attention, cpu, mxfp4, tiny
from finetune.architectures import model_family
from finetune.config import RunConfig
from finetune.config_files import requested_strategy
from finetune.errors import UserError

logger = logging.getLogger(__name__)

# peft's PeftModel (peft_model.py) and TRL read the attribute transformers 5.2x renamed; the warning is theirs to fix
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

LLAMA_3_2_TEMPLATE = tiny.TRL_CHAT_TEMPLATES_DIR / "llama3_2.jinja"
LLAMA_3_2_TRAINING_TEMPLATE = Path(__file__).parent / "chat_templates" / "llama3_2_training.jinja"


def resolve_model_path(run: RunConfig) -> str:
    """The folder or hub id to load: the recipe's model, or its tiny stand-in under --tiny."""
    name = run.model.model_name_or_path
    return str(tiny.tiny_model_folder(model_family(name), run.finetune.tiny_width)) if run.finetune.tiny else name


def load_tokenizer(model_path: str, assistant_only_loss: bool):
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except OSError as error:
        raise UserError(
            f"{model_path}: the tokenizer could not be loaded ({str(error).splitlines()[0]}); without network pass "
            f"a local model folder to --model_name_or_path, or add --tiny."
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if assistant_only_loss and tokenizer.chat_template == LLAMA_3_2_TEMPLATE.read_text(encoding="utf-8"):
        # TRL has no Llama 3.2 template with {% generation %} markers; ours renders identically and marks the
        # assistant's answer and its <|eot_id|>, so the model is trained to stop.
        tokenizer.chat_template = LLAMA_3_2_TRAINING_TEMPLATE.read_text(encoding="utf-8")
    return tokenizer


def model_init_kwargs(run: RunConfig, model_path: str) -> dict:
    kwargs = {
        "dtype": run.model.dtype or "auto",
        "attn_implementation": run.model.attn_implementation,
        "revision": run.model.model_revision,
        "trust_remote_code": run.training.trust_remote_code,
        "use_safetensors": True,
    }
    if run.finetune.experts_implementation and model_family(model_path) == "gpt-oss":
        kwargs["experts_implementation"] = run.finetune.experts_implementation
    quantization = get_quantization_config(run.model)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        kwargs["device_map"] = {"": "cpu" if cpu.on_cpu() else PartialState().local_process_index}
    elif mxfp4.is_mxfp4_checkpoint(model_path) and run.finetune.dequantize_mxfp4:
        # Training needs the experts in the training dtype: MXFP4 weights have no gradients. (transformers 5.24
        # dequantizes to the dtype the model loads in, 5.17 to bf16; FP4 values times powers of two are exact in both.)
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        if not cpu.on_cpu() and requested_strategy() not in ("fsdp", "zero3"):
            # Dequantized on the process's own GPU instead of the CPU: GPT-OSS-20B on the H200 loads in 2.7 s with
            # 14 GiB of host memory, against 79 s and 50 GiB per process on the CPU (docs/gpt-oss.md). Sharded
            # strategies load on the CPU and place the shards themselves.
            kwargs["device_map"] = {"": PartialState().local_process_index}
    return {key: value for key, value in kwargs.items() if value is not None}


def load_model(run: RunConfig, model_path: str) -> PreTrainedModel:
    if run.model.attn_implementation == attention.VARLEN_ATTENTION:
        attention.register()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, **model_init_kwargs(run, model_path))
    except OSError as error:
        raise UserError(
            f"{model_path}: the model could not be loaded ({str(error).splitlines()[0]}); without network pass "
            f"a local model folder to --model_name_or_path, or add --tiny."
        ) from None
    model.config.use_cache = False
    return model


def check_lora_targets(run: RunConfig, model_path: str) -> None:
    """LoRA target modules that match no layer of the model: refused before loading, naming the layers there are.
    peft adapts what matches and says nothing of a misspelled name beside a right one (or fails after loading when
    none matches). The model's layers are read from a skeleton on the meta device: no weights, no memory."""
    targets = run.model.lora_target_modules
    if not run.model.use_peft or not targets or targets in ("all-linear", ["all-linear"]) or isinstance(targets, str):
        return
    try:
        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception:  # a model this check cannot build on meta: peft's own check still runs at load
        return
    names = [name for name, module in skeleton.named_modules() if isinstance(module, torch.nn.Linear)]
    unmatched = [target for target in targets if not any(name == target or name.endswith("." + target) for name in names)]
    if unmatched:
        layers = sorted({name.rsplit(".", 1)[-1] for name in names})
        raise UserError(f"{run.recipe_path or 'command line'}: `lora_target_modules` {unmatched} match no layer of "
                        f"{run.model.model_name_or_path}; its linear layers are {layers} (or use all-linear).")


def lora_config(run: RunConfig) -> LoraConfig | None:
    return get_peft_config(run.model)


def fix_generation_config(model: PreTrainedModel, tokenizer) -> None:
    """Make generation stop where the chat template ends an assistant turn, not only at end-of-text."""
    generation = model.generation_config or GenerationConfig()
    eos_ids = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    eos_ids = [token for token in eos_ids if token is not None]
    if tokenizer.eos_token_id not in eos_ids:
        eos_ids.insert(0, tokenizer.eos_token_id)
    generation.eos_token_id = eos_ids
    generation.pad_token_id = tokenizer.pad_token_id
    generation.bos_token_id = tokenizer.bos_token_id
    model.generation_config = generation


def answer(
    model: PreTrainedModel, tokenizer, prompt: str, max_new_tokens: int = 24, chat_template_kwargs: dict | None = None
) -> str:
    """One greedy answer to a user message, through the chat template the model is trained with and the values it
    was trained with (`chat_template_kwargs`, e.g. GPT-OSS's reasoning_effort)."""
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True,
        **(chat_template_kwargs or {}),
    ).to(model.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True)
    model.train(was_training)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
