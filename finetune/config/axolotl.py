"""Recipes written for axolotl (github.com/axolotl-ai-cloud/axolotl), read in TRL's and finetune's names.

An axolotl recipe names its model `base_model` and its data as `datasets:` entries with a `type:`. Its keys that set
what a key of TRL, transformers or finetune sets are read under that name with their values, and axolotl's defaults
stand where TRL's differ; keys of axolotl's own machinery, which change nothing that is trained, are left out; every
other setting is refused at once, each with what to write instead. The meanings and defaults are those of axolotl's
schemas (src/axolotl/utils/schemas/), its config normalization (src/axolotl/utils/config/) and its trainer builder
(src/axolotl/core/builders/base.py). Plain dicts only: the planner reads recipes through here too.
"""

from dataclasses import dataclass, field

from finetune.errors import UserError
from finetune.families import FAMILIES, REASONING_FORMATS

# axolotl's name of a key of TRL, transformers or finetune: read under that name with its value
RENAMED = {
    "base_model": "model_name_or_path",
    "revision_of_model": "model_revision",
    "sequence_len": "max_length",
    "sample_packing": "packing",
    "eval_sample_packing": "eval_packing",
    "micro_batch_size": "per_device_train_batch_size",
    "eval_batch_size": "per_device_eval_batch_size",
    "num_epochs": "num_train_epochs",
    "optimizer": "optim",
    "lr_scheduler": "lr_scheduler_type",
    "dataset_processes": "dataset_num_proc",
    "peft_use_rslora": "use_rslora",
    "peft_use_dora": "use_dora",
    "wandb_name": "run_name",
}


# What TRL does differently under a renamed key, said beside it
CAVEATS = {"sequence_len": "longer rows are cut, where axolotl leaves them out"}


# axolotl's defaults where TRL's and transformers' differ, for the keys a recipe leaves out
AXOLOTL_DEFAULTS = {"max_length": 512, "per_device_train_batch_size": 1, "num_train_epochs": 1,
                    "lr_scheduler_type": "cosine", "save_total_limit": 4}


# The switches axolotl read before `attn_implementation` (May 2026), and the implementation each asks for
ATTENTION_SWITCHES = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa",
                      "flex_attention": "flex_attention", "eager_attention": "eager"}


# Left out: nothing that is trained changes
LEFT_OUT = (
    "strict", "debug",  # axolotl's check of its command line, and its logging of tokenized rows
    "dataset_prepared_path", "push_dataset_to_hub",  # where axolotl keeps its tokenized rows
    "loss_watchdog_threshold", "loss_watchdog_patience",  # axolotl stops a run whose loss diverges
    "save_first_step",  # a checkpoint after step 1, to try saving
    "pad_to_sequence_len",  # padding, which the loss leaves out
    "experimental_skip_move_to_device", "torchdistx_path",  # where the weights are first placed
    "tokenizer_type",  # AutoTokenizer loads the checkpoint's own
    # kernels computing the same
    "use_kernels", "cut_cross_entropy", "lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "liger_rope",
    "liger_rms_norm", "liger_glu_activation", "liger_layer_norm", "liger_fused_linear_cross_entropy",
    "liger_cross_entropy",
)


# axolotl's plugins with an equivalent here, and the settings they come to (none: the same training)
PLUGINS = {
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": {},  # the same loss, without the whole logits
    "axolotl.integrations.liger.LigerPlugin": {"use_liger_kernel": True},
}


FSDP_HINT = ("write FSDP2's settings in an accelerate config file such as accelerate_configs/fsdp.yaml and pass it to "
             "`finetune launch --config_file`")


# Keys with no setting here, and what to write instead
REFUSED = {
    "deepspeed": "name that JSON as `deepspeed_config_file` in an accelerate config file such as accelerate_configs/"
                 "zero3.yaml and pass it to `finetune launch --config_file`",
    "fsdp": FSDP_HINT,
    "fsdp_config": FSDP_HINT,
    "fsdp_version": FSDP_HINT,
    "unfrozen_parameters": "finetune trains every weight or LoRA adapters: remove it, or use `adapter: lora`",
    "tokens": "finetune adds no tokens to the vocabulary: remove it, or train a model whose tokenizer has them",
    "default_system_message": "give the rows a system turn instead",
    "lora_model_dir": "finetune trains new adapters: merge that one into its model (`finetune merge`) and give the "
                      "merged folder as `base_model`",
    "cosine_min_lr_ratio": "write `lr_scheduler_type: cosine_with_min_lr` and `lr_scheduler_kwargs: {min_lr_rate: R}`",
    "rl": "finetune trains SFT only: remove it",
    "pretraining_dataset": "give the text as a `datasets` entry with `type: completion`",
}


TEMPLATE_HINT = ("a template axolotl ships: write `chat_template: tokenizer_default` to train with the model's own, or "
                 "give its Jinja text as `chat_template_jinja`")


# The end-of-turn tokens of the chat templates here, which assistant_only_loss trains with each answer
TURN_ENDS = {family.tiny.eos_token for family in FAMILIES.values()} | {
    end for reasoning in REASONING_FORMATS for end in reasoning.ends}


WANDB_ENVIRONMENT = {"wandb_project": "WANDB_PROJECT", "wandb_entity": "WANDB_ENTITY", "wandb_watch": "WANDB_WATCH",
                     "wandb_log_model": "WANDB_LOG_MODEL", "wandb_mode": "WANDB_MODE", "wandb_run_id": "WANDB_RUN_ID"}


# `datasets` entries: the keys read in every entry and in those of a row type, the row types whose rows are
# conversations, and the turn keys of finetune's row readers (data/formats.py) with the column each is read from
SOURCE_KEYS = {"path", "name", "split", "type"}


CHAT_TEMPLATE_KEYS = {"field_messages", "message_property_mappings", "message_field_role", "message_field_content",
                      "roles_to_train", "train_on_eos", "chat_template", "field_thinking", "template_thinking_key"}


TYPE_KEYS = {"chat_template": CHAT_TEMPLATE_KEYS, "chat_template.default": CHAT_TEMPLATE_KEYS, "completion": {"field"}}


CONVERSATION_TYPES = {"alpaca", "chat_template", "chat_template.default", "sharegpt"}


TURN_COLUMNS = {("role", "content"): "messages", ("from", "value"): "conversations"}


def is_axolotl_recipe(recipe: dict) -> bool:
    """axolotl names the model `base_model` and gives each `datasets` entry a `type` (TRL's entries have none)."""
    entries = recipe.get("datasets")
    typed = isinstance(entries, list) and any(isinstance(entry, dict) and "type" in entry for entry in entries)
    return "base_model" in recipe or typed


@dataclass
class _Reading:
    """An axolotl recipe being read: its values (axolotl's keys not read yet beside finetune's), and what was read
    how."""

    values: dict
    said: list[str] = field(default_factory=list)
    defaulted: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    refused: dict[str, list[str]] = field(default_factory=dict)  # what to write instead -> the settings refused

    def give(self, source: str, settings: dict, said: str | None = None) -> None:
        """finetune's `settings` for axolotl's `source`, each where the recipe (or, in the planner, the command line)
        does not set that key itself: that value wins, as a flag wins in the run."""
        given = {key: value for key, value in settings.items() if key not in self.values}
        self.values.update(given)
        if given:
            values = ", ".join(f"`{key}: {_written(value)}`" for key, value in given.items())
            caveat = f" ({CAVEATS[source]})" if source in CAVEATS else ""
            self.said.append(said or f"`{source}` as {values}{caveat}")

    def switch(self, key: str) -> bool:
        """An on/off key of axolotl's, read; off asks for nothing, and is said to be left out."""
        if key in self.values and not self.values[key]:
            self.left_out.append(f"{key}: {_written(self.values[key])}")
        return bool(self.values.pop(key, False))

    def default(self, key: str, value) -> None:
        if key not in self.values:
            self.values[key] = value
            self.defaulted.append(f"`{key}: {_written(value)}`")

    def refuse(self, setting: str, hint: str, where: str = "") -> None:
        self.refused.setdefault(hint, []).append(f"{where}`{setting}`")


def _written(value) -> str:
    """A value as YAML writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return f"[{', '.join(map(_written, value))}]"
    return str(value)


def read_axolotl_recipe(recipe: dict, recipe_path: str) -> tuple[dict, list[str]]:
    """An axolotl recipe in TRL's and finetune's names, and what was read how (for read_foreign_keys' one line); any
    other recipe as it is. Every setting that cannot be honoured is refused at once, with the keys no one knows."""
    if not is_axolotl_recipe(recipe):
        return dict(recipe), []
    empty = [key for key, value in recipe.items() if value is None]  # unset in axolotl: its defaults stand
    reading = _Reading({key: value for key, value in recipe.items() if value is not None})
    for read in (_renamed, _model, _precision_and_memory, _tokens_and_template, _data, _saving, _reporting,
                 _left_out_and_refused):
        read(reading)
    for key, value in AXOLOTL_DEFAULTS.items():
        reading.default(key, value)
    if reading.refused:
        from finetune.config.schema import (
            run_fields,  # imported here: plan imports config_files, which reads through here
        )

        known = run_fields() | {"env"}
        for key in [key for key in reading.values if key not in known]:
            reading.refuse(key, "no such setting here: remove it")
        refused = [f"{', '.join(settings)} ({hint})" for hint, settings in reading.refused.items()]
        raise UserError(f"{recipe_path}: this axolotl recipe sets what finetune cannot honour: {', '.join(refused)}; "
                        f"change each as said (its other keys are read in finetune's names).")
    notes = [f"read axolotl's {', '.join(reading.said)}"] if reading.said else []
    if reading.defaulted:
        notes.append(f"axolotl's defaults for what it leaves out: {', '.join(reading.defaulted)}")
    left_out = [f"`{key}`" for key in reading.left_out] + ([f"{len(empty)} empty keys"] if empty else [])
    if left_out:
        notes.append(f"left out {', '.join(left_out)} (nothing trained changes: axolotl's own machinery, padding, "
                     f"kernels computing the same)")
    return reading.values, notes


def _renamed(reading: _Reading) -> None:
    values = reading.values
    for old, new in RENAMED.items():
        if old in values:
            reading.give(old, {new: values.pop(old)})
    for switch, implementation in ATTENTION_SWITCHES.items():
        if reading.switch(switch):
            reading.give(f"{switch}: true", {"attn_implementation": implementation})
    if reading.switch("group_by_length"):
        reading.give("group_by_length: true", {"train_sampling_strategy": "group_by_length"})


def _model(reading: _Reading) -> None:
    values = reading.values
    adapter = values.pop("adapter", None)
    if adapter in ("lora", "qlora"):
        reading.give(f"adapter: {adapter}", {"use_peft": True, "load_in_4bit": True} if adapter == "qlora"
                     else {"use_peft": True})
    elif adapter is not None:
        reading.refuse(f"adapter: {adapter}", "finetune trains LoRA (`adapter: lora`), QLoRA (`adapter: qlora`) or "
                                              "every weight (no `adapter`)")
    if reading.switch("lora_target_linear"):
        values.pop("lora_target_modules", None)  # axolotl adds every linear layer to them
        reading.give("lora_target_linear: true", {"lora_target_modules": "all-linear"})
    if "base_model_config" in values:
        if values.pop("base_model_config") == values.get("model_name_or_path"):
            reading.left_out.append("base_model_config")
        else:
            reading.refuse("base_model_config", "finetune reads the config beside the weights: remove it")
    if "model_type" in values:
        model_class = str(values.pop("model_type"))
        if model_class.endswith("ForCausalLM"):  # AutoModelForCausalLM loads the class the model's config names
            reading.left_out.append("model_type")
        else:
            reading.refuse(f"model_type: {model_class}", "finetune trains causal language models: remove it")
    quantization = values.pop("model_quantization_config", None)
    options = values.pop("model_quantization_config_kwargs", None) or {}
    if quantization == "Mxfp4Config" and options.get("dequantize"):
        reading.left_out.append("model_quantization_config")  # MXFP4 experts are dequantized on load here too
    elif quantization is not None:
        reading.refuse(f"model_quantization_config: {quantization}", "finetune loads MXFP4 checkpoints dequantized "
                                                                     "and quantizes with `adapter: qlora`: remove it")


def _precision_and_memory(reading: _Reading) -> None:
    values = reading.values
    setting = values.get("bf16", "auto")
    if setting in ("auto", "full"):  # axolotl's default, `auto`: bf16 where the GPU has it (a CPU trains in float32)
        values.pop("bf16", None)
        reading.give(f"bf16: {setting}", {"bf16": True})
    # axolotl loads the weights in the precision it trains in; TRL in float32 unless `dtype` says otherwise
    bf16 = values["bf16"]
    weights = "bfloat16" if bf16 else "float16" if values.get("fp16") or values.get("load_in_8bit") else "float32"
    reading.give(f"bf16: {_written(bf16)}", {"dtype": weights})
    if values.get("tf32") == "auto":  # transformers' default leaves torch's choice
        del values["tf32"]
        reading.left_out.append("tf32: auto")
    for name in ("gradient_checkpointing", "activation_checkpointing"):  # the run has read the old name as the new
        if values.get(name) in ("offload", "offload_disk"):
            reading.refuse(f"gradient_checkpointing: {values.pop(name)}",
                           "write `gradient_checkpointing: true` and `activation_offloading: true`")
    if isinstance(values.get("activation_offloading"), str):
        reading.refuse(f"activation_offloading: {values.pop('activation_offloading')}",
                       "write `activation_offloading: true`, TRL's offloading to CPU memory")
    if values.get("torch_compile") == "auto":
        reading.refuse(f"torch_compile: {values.pop('torch_compile')}", "write `torch_compile: true` or `false`")
    for switch in ("xformers_attention", "sage_attention"):
        if reading.switch(switch):
            reading.refuse(f"{switch}: true", "write `attn_implementation: sdpa` or `flash_attention_2`")


def _tokens_and_template(reading: _Reading) -> None:
    values = reading.values
    special = dict(values.pop("special_tokens", {}))
    if special.pop("pad_token", None) is not None:  # TRL leaves padding out of the loss by its place, whatever token
        reading.left_out.append("special_tokens.pad_token")
    if "eos_token" in special:
        reading.give("special_tokens.eos_token", {"eos_token": special.pop("eos_token")})
    for name in special:
        reading.refuse(f"special_tokens.{name}", "finetune sets only the end-of-sequence token: remove it")
    turn_ends = values.pop("eot_tokens", [])
    if turn_ends and set(turn_ends) <= TURN_ENDS:
        reading.left_out.append("eot_tokens")
    elif turn_ends:
        reading.refuse(f"eot_tokens: {_written(turn_ends)}", "assistant_only_loss trains the chat template's own "
                                                            "end-of-turn token with each answer: remove it")
    template, jinja = values.pop("chat_template", None), values.pop("chat_template_jinja", None)
    if jinja and template in (None, "jinja"):
        key = "chat_template" if "{" in jinja else "chat_template_path"  # axolotl takes the text or its file
        reading.give("chat_template_jinja", {key: jinja}, said=f"`chat_template_jinja` as `{key}`")
    elif template == "tokenizer_default":
        reading.left_out.append("chat_template: tokenizer_default")  # the tokenizer's own, as here
    elif template is not None:
        reading.refuse(f"chat_template: {template}", TEMPLATE_HINT)


def _data(reading: _Reading) -> None:
    """`datasets` as `dataset_mixture`, `val_set_size` as its test share with the evaluation axolotl derives from it,
    and `train_on_inputs` as `assistant_only_loss`."""
    values = reading.values
    entries = values.pop("datasets", None)
    test_share = values.pop("val_set_size", 0)
    train_on_inputs = values.pop("train_on_inputs", False)
    evaluations = values.pop("evals_per_epoch", None)
    if not test_share:
        reading.give("val_set_size: 0", {"eval_strategy": "no"})
    elif evaluations and "eval_steps" not in values:
        share = 1 / (evaluations * values.get("num_train_epochs", AXOLOTL_DEFAULTS["num_train_epochs"]))
        if share < 1:  # axolotl's rule: a share of 1 would evaluate every step, and it then evaluates never
            reading.give(f"evals_per_epoch: {evaluations}", {"eval_steps": share, "eval_strategy": "steps"})
    elif "eval_steps" in values:
        reading.give("eval_steps", {"eval_strategy": "steps"})
    if not isinstance(entries, list):
        if entries is not None:
            reading.refuse("datasets", "give a list of entries such as {path: tatsu-lab/alpaca, type: alpaca}")
        return
    sources = [_source(entry, number, reading) for number, entry in enumerate(entries, start=1)]
    types = {entry.get("type") for entry in entries if isinstance(entry, dict)}
    alpaca = " (alpaca rows as conversations in the model's chat template)" if "alpaca" in types else ""
    mixture = {"datasets": sources, **({"test_split_size": test_share} if test_share else {})}
    said = f"`datasets`{' and `val_set_size`' if test_share else ''} as `dataset_mixture`{alpaca}"
    reading.give("datasets", {"dataset_mixture": mixture}, said=said)
    if types <= CONVERSATION_TYPES:
        reading.give(f"train_on_inputs: {_written(bool(train_on_inputs))}",
                     {"assistant_only_loss": not train_on_inputs})


def _source(entry, number: int, reading: _Reading) -> dict:
    """One `datasets` entry as a `dataset_mixture` entry, its validation rows taken from its training rows as axolotl
    takes them (never from a test split)."""
    where = f"datasets entry {number} "
    if not isinstance(entry, dict) or not entry.get("path"):
        reading.refuse("path", "give each entry a hub id, folder or file as `path`", where)
        return {}
    for key in sorted(set(entry) - SOURCE_KEYS - TYPE_KEYS.get(entry.get("type"), set())):
        reading.refuse(key, "no equivalent here, where rows are rendered with the model's chat template: remove it",
                       where)
    split = str(entry.get("split", "train"))
    if "[" in split:
        reading.refuse(f"split: {split}", "finetune loads whole splits: give `split: train`, or save the rows you "
                                          "want to a file and give its path", where)
    source = {"path": entry["path"], "split": split, "test_split": None}
    if entry.get("name"):
        source["name"] = entry["name"]
    row_type = entry.get("type")
    if row_type in ("chat_template", "chat_template.default"):
        column = _conversation_column(entry, where, reading)
        if column and entry.get("field_messages", "messages") != column:
            source["columns"] = {entry.get("field_messages", "messages"): column}
    elif row_type == "completion" and entry.get("field", "text") != "text":
        source["columns"] = {entry["field"]: "text"}
    elif row_type not in (None, "alpaca", "sharegpt", "completion"):
        reading.refuse(f"type: {row_type}", "finetune reads alpaca, chat_template, sharegpt and completion rows: "
                                            "convert the rows to `messages` and give `type: chat_template`", where)
    return source


def _conversation_column(entry: dict, where: str, reading: _Reading) -> str | None:
    """The column finetune reads these turns from (`messages` for role/content, `conversations` for ShareGPT's
    from/value), or None after refusing what it cannot read as axolotl does."""
    mapping = entry.get("message_property_mappings") or {"role": entry.get("message_field_role", "role"),
                                                          "content": entry.get("message_field_content", "content")}
    column = TURN_COLUMNS.get((mapping.get("role"), mapping.get("content")))
    if column is None or set(mapping) - {"role", "content"}:
        reading.refuse("message_property_mappings", "finetune reads turns of role/content or from/value: rename the "
                                                    "rows' keys to one of them", where)
    if entry.get("roles_to_train", ["assistant"]) != ["assistant"] or entry.get("train_on_eos", "turn") != "turn":
        reading.refuse("roles_to_train", "finetune trains each assistant turn and its end-of-turn token, axolotl's "
                                         "default: remove roles_to_train and train_on_eos", where)
    if entry.get("chat_template", "tokenizer_default") != "tokenizer_default":
        reading.refuse(f"chat_template: {entry['chat_template']}", TEMPLATE_HINT, where)
    thinking = entry.get("field_thinking", "reasoning_content")
    if thinking != entry.get("template_thinking_key", "reasoning_content"):
        reading.refuse(f"field_thinking: {thinking}", "the rows' reasoning reaches the chat template under its own "
                                                      "key here: name the field as template_thinking_key", where)
    return column


def _saving(reading: _Reading) -> None:
    """axolotl's rule: saves_per_epoch as a share of the run, unless that share is 1 or more: then once an epoch, its
    default."""
    values = reading.values
    saves = values.pop("saves_per_epoch", None)
    if saves and "save_steps" not in values:
        share = 1 / (saves * values.get("num_train_epochs", AXOLOTL_DEFAULTS["num_train_epochs"]))
        if share < 1:
            reading.give(f"saves_per_epoch: {saves}", {"save_steps": share})
    if "save_steps" not in values:
        reading.default("save_strategy", "epoch")


def _reporting(reading: _Reading) -> None:
    values = reading.values
    wandb = {key: values.pop(key) for key in WANDB_ENVIRONMENT if key in values}
    if wandb:
        variables = {WANDB_ENVIRONMENT[key]: str(value) for key, value in wandb.items()}
        values["env"] = {**variables, **(values.get("env") or {})}
        reading.said.append(f"{', '.join(f'`{key}`' for key in wandb)} as `env:` {', '.join(variables)}")
    reporters = ["wandb"] * ("wandb_project" in wandb) + ["tensorboard"] * reading.switch("use_tensorboard")
    if reporters:  # axolotl reports to wandb when it names a project
        reading.give("wandb_project, use_tensorboard", {"report_to": reporters})
    if values.get("hub_model_id"):
        reading.give("hub_model_id", {"push_to_hub": True})


def _left_out_and_refused(reading: _Reading) -> None:
    values = reading.values
    for plugin in values.pop("plugins", []):
        name = plugin.rsplit(".", 1)[-1]
        if plugin not in PLUGINS:
            reading.refuse(f"plugins: {name}", "no equivalent here: remove it")
        elif PLUGINS[plugin]:
            reading.give(f"plugins: {name}", PLUGINS[plugin])
        else:
            reading.left_out.append(f"plugins: {name}")
    reading.left_out += [key for key in LEFT_OUT if values.pop(key, None) is not None]
    for key, hint in REFUSED.items():
        if key in values:
            del values[key]
            reading.refuse(key, hint)
