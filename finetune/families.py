"""The model families finetune knows, one entry each: what differs between Llama 3.2 and GPT-OSS lives here and
nowhere else. An entry holds the hub ids of the family's checkpoints and the stored architecture of each, the tiny
stand-in `--tiny` trains (built by finetune/models/tiny.py), the chat template, the reasoning format, and the planner's
terms for a decoder layer's weights (finetune/planner/). `family_of` says which family a model is of, and refuses a
model of none in one sentence that lists them, before anything loads.

Adding a family is one entry in FAMILIES plus its files:
- model_configs/ARCHITECTURE.json: the config.json of each hub checkpoint (quantization left out), for the planner,
  the benchmarks and the tiny model, since there may be no hub to ask;
- tiny_tokenizers/FAMILY/tokenizer.json: its tiny tokenizer, trained by scripts/build_tiny_assets.py;
- chat_templates/NAME.jinja: only when TRL has no copy of the family's chat template with {% generation %} markers.

Plain data, json and pathlib: the planner imports this module and must answer at once, so transformers and
huggingface_hub are imported inside the functions that need them, and torch never.
"""

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import UserError
from finetune.json_files import read_object

MODEL_CONFIGS_DIR = Path(__file__).parent / "model_configs"
CHAT_TEMPLATES_DIR = Path(__file__).parent / "chat_templates"
TINY_WIDTH = 64  # every tiny stand-in's hidden size: the tests' width; --tiny_width scales a family from it


@dataclass(frozen=True)
class ReasoningFormat:
    """How a family's chat template writes a reply's reasoning beside its answer."""

    name: str
    tags: tuple[str, ...]  # what the template writes around each message; inside a row's text, read as turn boundaries
    channel: str  # opens a channel header: a generated reply holding one has channels
    final: str  # the header of the channel whose message is the answer (the others hold the reasoning)
    ends: tuple[str, ...]  # what ends a turn


@dataclass(frozen=True)
class TinyModel:
    """The family's tiny stand-in: its tokenizer's special tokens in the roles the hub checkpoints give them, and the
    stored architecture with the same attention layout and kind of MLP, scaled down."""

    bos_token: str
    eos_token: str
    pad_token: str
    architecture: str  # model_configs/ARCHITECTURE.json
    scaled_down: dict  # config values replaced; `hidden_size` is TINY_WIDTH


def _no_weights(architecture) -> dict[str, tuple[int, int]]:
    return {}


def _no_parameters(architecture) -> int:
    return 0


@dataclass(frozen=True)
class Family:
    """Everything finetune does differently for the models of one family."""

    name: str  # the tiny model's folder and tokenizer: tiny_tokenizers/NAME/
    model_types: tuple[str, ...]  # config.json's `model_type`
    hub_ids: dict[str, str]  # hub id -> its stored architecture, model_configs/ARCHITECTURE.json
    name_words: tuple[str, ...]  # in a hub id, say the family when no config.json can be read (offline, not cached)
    chat_template: str  # TRL's copy (trl/chat_templates/) of the template the hub tokenizers carry
    training_chat_template: str | None  # ours with generation markers (chat_templates/); None: TRL has one
    tiny: TinyModel
    reasoning: ReasoningFormat | None = None
    experts: bool = False  # mixture of experts: `experts_implementation` and `lora_target_parameters` apply
    mxfp4_hub_checkpoints: bool = False  # its hub ids store the experts in MXFP4 (their stored configs do not say so)
    # the model class that builds its attention masks without the position ids (packed rows need them: patches.py)
    masks_without_positions: str | None = None
    # The planner's terms, functions of its Architecture (finetune/planner/):
    mlp_linears: Callable = _no_weights  # the MLP's nn.Linear layers, name -> (in, out): LoRA targets, 4-bit weights
    expert_weights: Callable = _no_weights  # one expert's weights, each with a bias, name -> (in, out)
    other_layer_parameters: Callable = _no_parameters  # a decoder layer's beyond attention, MLP and norms


def gated_mlp(a) -> dict[str, tuple[int, int]]:
    """Llama's MLP: gate and up project the hidden state to the intermediate width, down projects it back."""
    return {"gate_proj": (a.hidden, a.intermediate), "up_proj": (a.hidden, a.intermediate),
            "down_proj": (a.intermediate, a.hidden)}


def gpt_oss_expert(a) -> dict[str, tuple[int, int]]:
    """One GPT-OSS expert: gate and up fused into one weight, then down."""
    return {"gate_up_proj": (a.hidden, 2 * a.intermediate), "down_proj": (a.intermediate, a.hidden)}


# MXFP4-resident experts are dequantized at most this many bytes of one projection at a time, a chunk of whole experts
# (at least one): finetune/models/mxfp4_experts.py computes with it and finetune/planner/memory.py counts it. A whole
# GPT-OSS-120B projection is 128 experts, 3.96 GiB in bf16, beside 60.8 GiB of resident weights; 32 of them are 0.99.
# GPT-OSS-20B's gate_up (32 experts, 0.99 GiB) is taken whole: one GEMM, no read back of the offsets, no copy of the
# chunks' outputs into the projection's.
DEQUANTIZED_CHUNK_BYTES = 2**30
# Whether the next chunk is dequantized ahead, on a second CUDA stream during this chunk's grouped GEMM
# (mxfp4_experts.DequantizePrefetch computes so; the planner counts what it holds when false, as tests/test_plan.py
# asserts): no, the GEMMs hold every multiprocessor (persistent CUTLASS kernels), so it waits for them and then delays
# the kernels after them. One H100, GPT-OSS-20B, 4 layers of experts at 8,192 tokens (docs/benchmarks.md, 2026-12-06):
# 94.07 ms without against 94.87 with it (checkpointing), 68.10 against 68.96 (without).
DEQUANTIZE_AHEAD = False
# Where the experts get at most this many routed rows each on average, the GEMM decodes the MXFP4 weights inside its
# tiles instead (finetune/models/mxfp4_grouped_gemm.py) and nothing is dequantized. One H100, 2026-12-06
# (docs/benchmarks.md), fused over chunked time, GPT-OSS-20B and -120B, forward and transposed: 0.38-0.91 at 64-256
# rows an expert, 0.98-1.12 at 512, 1.36-1.84 at 1,024-2,048.
FUSED_GEMM_MAX_ROWS_PER_EXPERT = 256


def fused_gemm_takes(rows: int, experts: int) -> bool:
    """Whether a GPU computes the resident experts' GEMM of `rows` routed rows with the fused kernel."""
    return rows <= FUSED_GEMM_MAX_ROWS_PER_EXPERT * experts


def dequantized_chunk_experts(expert_bytes: int, experts: int) -> int:
    """How many whole experts of a projection are dequantized together: as many as DEQUANTIZED_CHUNK_BYTES holds, at
    least one, at most all."""
    return min(experts, max(1, DEQUANTIZED_CHUNK_BYTES // expert_bytes))


def gpt_oss_router_and_sinks(a) -> int:
    """The router (hidden -> experts, with a bias) and one attention sink per head."""
    return a.hidden * a.experts + a.experts + a.heads


HARMONY = ReasoningFormat(
    name="harmony",
    tags=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>",
          "<|startoftext|>", "<|endoftext|>"),
    channel="<|channel|>",
    final="<|channel|>final<|message|>",
    ends=("<|return|>", "<|end|>", "<|call|>"),
)

# The TRL copy of each chat template is the one used, not a copy of our own, so that TRL's template recognition
# (get_training_chat_template) sees the exact string it compares against.
FAMILIES = {family.name: family for family in (
    Family(
        name="llama",
        model_types=("llama", "mistral"),  # Mistral's decoder layer is Llama's (alignment-handbook's zephyr recipes)
        hub_ids={"meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b", "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
                 "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b", "meta-llama/Llama-3.2-3B": "llama-3.2-3b"},
        name_words=("llama", "mistral"),
        chat_template="llama3_2.jinja",
        training_chat_template="llama3_2_training.jinja",
        tiny=TinyModel(  # GQA and tied embeddings, as Llama-3.2-1B
            bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>",
            architecture="llama-3.2-1b",
            scaled_down={"hidden_size": TINY_WIDTH, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
        ),
        mlp_linears=gated_mlp,
    ),
    Family(
        name="gpt-oss",
        model_types=("gpt_oss",),
        hub_ids={"openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b"},
        name_words=("gpt-oss",),
        chat_template="gptoss.jinja",
        training_chat_template=None,
        tiny=TinyModel(  # GQA with sinks, alternating sliding and full layers, 4 experts with top-2 routing
            bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>",
            architecture="gpt-oss-20b",
            scaled_down={"hidden_size": TINY_WIDTH, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                         "num_experts_per_tok": 2, "experts_per_token": 2,
                         "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16},
        ),
        reasoning=HARMONY,
        experts=True,
        mxfp4_hub_checkpoints=True,
        masks_without_positions="GptOssModel",
        expert_weights=gpt_oss_expert,
        other_layer_parameters=gpt_oss_router_and_sinks,
    ),
)}
REASONING_FORMATS = tuple(dict.fromkeys(family.reasoning for family in FAMILIES.values() if family.reasoning))


# ---- Which family a model is of ---------------------------------------------------------------------------------
def family_of(model: str, revision: str | None = None) -> Family:
    """The family of one of its hub ids or stored architectures, of a LoRA adapter's base model, of the model type
    a config.json names (a local folder's, else the hub's: read from the cache offline), or, with no config.json to
    read, of a word of the hub id; a model of no family is refused in one sentence that lists the families."""
    return family_if_told(model, revision) or family_of_type(None, model)


def family_if_told(model: str, revision: str | None = None) -> Family | None:
    """`family_of`, but None where neither a config.json nor the hub id's words tell the model type (offline and not
    in the cache); a model type that is read and of no family is refused all the same."""
    listed = next((family for family in FAMILIES.values()
                   if model in family.hub_ids or model in family.hub_ids.values()), None)
    if listed is not None:
        return listed
    base = read_object(Path(model).expanduser() / "adapter_config.json").get("base_model_name_or_path")
    if isinstance(base, str) and base:
        return family_if_told(base)
    model_type = _model_type(model, revision)
    if model_type is None:
        return next((family for family in FAMILIES.values()
                     if any(word in model.lower() for word in family.name_words)), None)
    return family_of_type(model_type, model)


def family_of_type(model_type: str | None, model: str) -> Family:
    """The family whose models name `model_type` in their config.json; refused, naming the model, when none does."""
    family = next((family for family in FAMILIES.values() if model_type in family.model_types), None)
    if family is None:
        found = f"`model_type: {model_type}` (its config.json) is" if model_type else (
            "neither a config.json (in its folder, on the hub or in the hub cache) nor its name tells its model type, "
            "so it is")
        known = ", ".join(f"{family.name} (model_type {', '.join(family.model_types)})" for family in FAMILIES.values())
        raise UserError(f"{model}: {found} of no model family finetune knows ({known}); pass a model of one of them as "
                        f"model_name_or_path, or add its family to finetune/families.py.")
    return family


def _model_type(model: str, revision: str | None) -> str | None:
    """The `model_type` of a local folder's config.json, else of the hub's (never downloading when HF_HUB_OFFLINE
    is set); None when there is none to read."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        return read_object(folder / "config.json").get("model_type")
    from huggingface_hub import hf_hub_download

    try:
        return read_object(Path(hf_hub_download(model, "config.json", revision=revision))).get("model_type")
    except (OSError, ValueError):  # not a hub id, not on the hub, or offline and not in the cache
        return None


# ---- The stored architectures -----------------------------------------------------------------------------------
def stored_architecture(model: str) -> str | None:
    """The stored architecture of a hub id or an architecture name, or None when it is not one of the families'."""
    for family in FAMILIES.values():
        if model in family.hub_ids:
            return family.hub_ids[model]
    return model if (MODEL_CONFIGS_DIR / f"{model}.json").is_file() else None


def config_values(model: str) -> tuple[str, dict]:
    """The name and the config.json values of a model: the stored copy for the families' hub ids, else a local
    folder's. Plain JSON, so the planner reads it without transformers. ValueError when neither exists (never
    downloads): the planner says it in its own words."""
    name = stored_architecture(model)
    if name is not None:
        return name, json.loads((MODEL_CONFIGS_DIR / f"{name}.json").read_text())
    local = Path(model) / "config.json"
    if local.is_file():
        return Path(model).name, json.loads(local.read_text())
    hub_ids = sorted(hub_id for family in FAMILIES.values() for hub_id in family.hub_ids)
    raise ValueError(f"Unknown model {model!r}: not one of {hub_ids} and no config.json there.")


def load_architecture(model: str):
    """The model's transformers config, from the stored copies for the families' hub ids or from a local folder."""
    from transformers import AutoConfig

    if stored_architecture(model) is None:
        return AutoConfig.from_pretrained(model)
    _, values = config_values(model)
    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


# ---- Chat templates ---------------------------------------------------------------------------------------------
def trl_chat_template(family: Family) -> str:
    """The text of TRL's copy of the family's chat template (found without importing trl)."""
    trl_folder = Path(importlib.util.find_spec("trl").origin).parent
    return (trl_folder / "chat_templates" / family.chat_template).read_text(encoding="utf-8")


def training_chat_template(chat_template: str | None) -> str | None:
    """For a family's chat template that TRL has no marked copy of (Llama 3.2's), ours with {% generation %} markers:
    it renders identically and marks the assistant's answer and its end of turn, so the model is trained to stop.
    None for any other template."""
    for family in FAMILIES.values():
        if family.training_chat_template and chat_template == trl_chat_template(family):
            return (CHAT_TEMPLATES_DIR / family.training_chat_template).read_text(encoding="utf-8")
    return None
