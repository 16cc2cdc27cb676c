"""Tokenizer, model and LoRA config for a run: a hub id, a local folder, or (with --tiny) a tiny random model of the
recipe's family written to a local folder, so that all three load through the same `from_pretrained` call; and the
check every command makes of a model before loading it (`check_model`).
"""

import contextlib
import re
import warnings

from accelerate import PartialState
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Mxfp4Config, PreTrainedModel
from trl import get_peft_config, get_quantization_config

from finetune import families, patches
from finetune.checks import resume
from finetune.checks.model_folder import REMAKE, REMAKE_ADAPTER, nonfinite_sentence
from finetune.errors import UserError, first_line
from finetune.models import attention, cpu, mxfp4, mxfp4_loading
from finetune.run.arguments import RunConfig

# peft's PeftModel (peft_model.py) and TRL read the attribute transformers 5.2x renamed; the warning is theirs to fix
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


# peft's (torch's) message for the first tensor of an adapter that does not fit the model it is loaded on
SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[[^\]]*\])\) from "
                           r"checkpoint, the shape in current model is torch.Size\((\[[^\]]*\])\)")


def load_adapter(model: PreTrainedModel, adapter_dir: str, base: str, base_flag: str):
    """The LoRA adapter of `adapter_dir` on its loaded base `model`; one trained on another model (its layers of other
    shapes) ends in one sentence instead of peft's list of every mismatched tensor."""
    from peft import PeftModel

    def refusal(file, error) -> UserError:
        return UserError(f"{file or adapter_dir}: {resume.unreadable_reason(error)}; {REMAKE_ADAPTER}.")

    try:
        with patches.weights_only_loads(resume.checkpoint_classes(), refusal):  # an adapter_model.bin is a pickle
            return PeftModel.from_pretrained(model, adapter_dir)
    except RuntimeError as error:
        mismatch = SIZE_MISMATCH.search(str(error))
        if mismatch is None:
            raise
        name, adapter_shape, model_shape = mismatch.groups()
        raise UserError(f"{adapter_dir}: this adapter was not trained on {base} ({name} is {adapter_shape} in the "
                        f"adapter, {model_shape} on this model); pass the model it was trained on to {base_flag}.") from None


def check_finite(model, base: str, adapter_dir: str | None = None) -> None:
    """A loaded model whose weights hold NaN or infinite values: every output they touch is NaN, and a run trained on
    them logged its loss as 0 (the Trainer's `logging_nan_inf_filter`) and saved, exit 0. Read where the weights are,
    one float32 sum per tensor (non-finite if any element is), after loading: the headers do not tell it. An adapter's
    tensors (`lora_` in the name) are named in `adapter_dir`."""
    import torch

    for name, parameter in model.named_parameters():
        if not parameter.is_floating_point() or parameter.numel() == 0 or parameter.device.type == "meta":
            continue  # packed or quantized integers, or a shard placeholder of a sharded strategy
        if not torch.isfinite(torch.sum(parameter.detach(), dtype=torch.float32)):
            in_adapter = adapter_dir is not None and "lora_" in name
            raise UserError(nonfinite_sentence(adapter_dir if in_adapter else base, name,
                                               REMAKE_ADAPTER if in_adapter else REMAKE))


def load_tokenizer(model_path: str, assistant_only_loss: bool, flag: str = "--model_name_or_path"):
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as error:  # ValueError: a folder without tokenizer files
        reason = str(error).splitlines()[0].rstrip(": ")
        raise UserError(
            f"{model_path}: the tokenizer could not be loaded ({reason}); give {flag} a model folder that holds its "
            f"tokenizer files (copy them from the model it was trained from), or without network a local copy of the "
            f"model."
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if assistant_only_loss:
        tokenizer.chat_template = families.training_chat_template(tokenizer.chat_template) or tokenizer.chat_template
    return tokenizer


def model_init_kwargs(run: RunConfig, model_path: str) -> dict:
    kwargs = {
        "dtype": run.model.dtype or "auto",
        "attn_implementation": run.model.attn_implementation,
        "revision": run.model.model_revision,
        "trust_remote_code": run.training.trust_remote_code,
        "use_safetensors": True,
    }
    if run.finetune.experts_implementation and families.family_of(model_path, run.model.model_revision).experts:
        kwargs["experts_implementation"] = run.finetune.experts_implementation
    quantization = get_quantization_config(run.model)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        kwargs["device_map"] = {"": "cpu" if cpu.on_cpu() else PartialState().local_process_index}
    elif mxfp4.is_mxfp4_checkpoint(model_path) and run.finetune.dequantize_mxfp4:
        # Training needs the experts in the training dtype: MXFP4 weights have no gradients. (transformers 5.24
        # dequantizes to the dtype the model loads in, 5.17 to bf16; FP4 values times powers of two are exact in both.)
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        if not cpu.on_cpu() and run.launch.strategy not in ("fsdp", "zero3"):
            # Dequantized on the process's own GPU instead of the CPU: GPT-OSS-20B on the H200 loads in 2.7 s with
            # 14 GiB of host memory, against 79 s and 50 GiB per process on the CPU (docs/gpt-oss.md). Sharded
            # strategies load on the CPU and place the shards themselves.
            kwargs["device_map"] = {"": PartialState().local_process_index}
    elif mxfp4.is_mxfp4_checkpoint(model_path):  # experts kept in MXFP4 (mxfp4_loading): on the process's device
        kwargs["device_map"] = {"": "cpu" if cpu.on_cpu() else PartialState().local_process_index}
    return {key: value for key, value in kwargs.items() if value is not None}


def load_mxfp4_resident(model_path: str, kwargs: dict) -> PreTrainedModel:
    """from_pretrained's arguments (model_init_kwargs) applied to the MXFP4 loader that keeps the experts packed."""
    kwargs = {key: value for key, value in kwargs.items() if key != "use_safetensors"}  # it reads safetensors only
    return mxfp4_loading.load(model_path, device=kwargs.pop("device_map")[""], **kwargs)


def loads_whole_under_zero3(run: RunConfig) -> bool:
    """A ZeRO-3 launch whose `zero3_init_flag` is false: every process loads the whole model, which DeepSpeed
    partitions when the Trainer prepares it, as accelerate documents the flag (transformers would otherwise load under
    deepspeed.zero.Init whatever it says)."""
    plugin = run.training.deepspeed_plugin
    return plugin is not None and plugin.hf_ds_config.is_zero3() and not plugin.is_zero3_init_enabled()


def load_model(run: RunConfig, model_path: str) -> PreTrainedModel:
    if run.model.attn_implementation == attention.VARLEN_ATTENTION:
        attention.register()
    if cpu.on_cpu() and run.training.deepspeed:
        cpu.deepspeed_on_the_process_group()
    try:
        kwargs = model_init_kwargs(run, model_path)
        with patches.zero3_init_off() if loads_whole_under_zero3(run) else contextlib.nullcontext():
            if mxfp4.is_mxfp4_checkpoint(model_path) and "quantization_config" not in kwargs:
                model = load_mxfp4_resident(model_path, kwargs)
            else:
                model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    except OSError as error:
        raise UserError(
            f"{model_path}: the model could not be loaded ({first_line(error)}); without network pass "
            f"a local model folder to --model_name_or_path, or add --tiny."
        ) from None
    check_finite(model, model_path)
    model.config.use_cache = False
    return model


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
