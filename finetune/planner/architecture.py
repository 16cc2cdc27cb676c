"""A model's shape for the planner (hidden size, layers, heads, experts) and the parameter counts that follow from
it, read from the project's copy of a hub config or a local folder's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass

from finetune.errors import UserError
from finetune.families import FAMILIES, config_values, family_of_type

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- Architecture ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width, or one expert's width for MoE
    vocab: int
    tied_embeddings: bool
    attention_bias: bool = False
    experts: int = 0  # 0: dense MLP
    experts_per_token: int = 0
    family: str = "llama"  # whose layer layout (finetune/families.py); one built by hand is a Llama's
    mxfp4_experts: bool = False  # the checkpoint stores the experts in MXFP4 (`dequantize_mxfp4` applies)

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


def architecture_from_config(values: dict, name: str = "", mxfp4_hub_checkpoint: bool = False) -> Architecture:
    """The few numbers the planner needs, from a config.json's values (and whether the model is a hub checkpoint
    that stores its experts in MXFP4, which the stored copy of its config does not say)."""
    text = values.get("text_config", values)
    quantization = values.get("quantization_config") or {}
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    experts = text.get("num_local_experts") or text.get("num_experts") or 0
    return Architecture(
        name=name or text.get("model_type", "model"),
        hidden=hidden,
        layers=text["num_hidden_layers"],
        heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or hidden // heads,
        intermediate=text.get("moe_intermediate_size") or text["intermediate_size"],
        vocab=text["vocab_size"],
        tied_embeddings=bool(values.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        attention_bias=bool(text.get("attention_bias", False)),
        experts=experts,
        experts_per_token=(text.get("num_experts_per_tok") or text.get("experts_per_token") or 0) if experts else 0,
        family=family_of_type(values.get("model_type"), name or "config.json").name,
        mxfp4_experts=bool(experts) and (mxfp4_hub_checkpoint or quantization.get("quant_method") == "mxfp4"),
    )


def architecture_of(model_name_or_path: str, source: str = "command line") -> Architecture:
    """The planner's numbers for a known hub id or a local folder with a config.json. Never downloads. A model it
    cannot read is a UserError naming `source` (the recipe) or the config.json."""
    try:
        name, values = config_values(model_name_or_path)
    except json.JSONDecodeError as error:
        raise UserError(f"{model_name_or_path}/config.json: not valid JSON at line {error.lineno}; fix the syntax "
                        f"there.") from None
    except ValueError as error:
        raise UserError(f"{source}: the planner cannot read `model_name_or_path: {model_name_or_path}` "
                        f"({str(error).rstrip('.')}); give a local folder holding the model's config.json, or pass "
                        f"--config_file to `finetune launch` to choose the technique yourself.") from None
    try:
        family = family_of_type(values.get("model_type"), name)
        hub_mxfp4 = family.mxfp4_hub_checkpoints and model_name_or_path in family.hub_ids
        return architecture_from_config(values, name, hub_mxfp4)
    except KeyError as missing:
        raise UserError(f"{model_name_or_path}/config.json: no `{missing.args[0]}`, which the planner needs for a "
                        f"decoder-only language model; give the folder of such a model.") from None


# ---- Parameter counts --------------------------------------------------------------------------------------------
def attention_linears(a: Architecture) -> dict[str, tuple[int, int]]:
    """Per decoder layer: (input features, output features) of q, k, v, o."""
    return {"q_proj": (a.hidden, a.attn_dim), "k_proj": (a.hidden, a.kv_dim), "v_proj": (a.hidden, a.kv_dim),
            "o_proj": (a.attn_dim, a.hidden)}


def attention_params(a: Architecture) -> dict[str, int]:
    """Per decoder layer: input features x output features (+ bias) of q, k, v, o."""
    bias = 1 if a.attention_bias else 0
    return {k: i * o + bias * o for k, (i, o) in attention_linears(a).items()}


def mlp_params(a: Architecture) -> dict[str, int]:
    """Per decoder layer, as the family lays it out (finetune/families.py): its MLP's linear layers (Llama: gate, up,
    down), or every expert's weights and biases (GPT-OSS: fused gate_up, and down)."""
    family = FAMILIES[a.family]
    linears = {name: i * o for name, (i, o) in family.mlp_linears(a).items()}
    return linears | {f"experts.{name}": a.experts * (i * o + o) for name, (i, o) in family.expert_weights(a).items()}


def layer_params(a: Architecture) -> int:
    norms = 2 * a.hidden
    other = FAMILIES[a.family].other_layer_parameters(a)  # GPT-OSS: the router and the per-head attention sinks
    return sum(attention_params(a).values()) + sum(mlp_params(a).values()) + norms + other


def embedding_params(a: Architecture) -> int:
    """Input embedding + LM head (one matrix when tied) + final norm."""
    return a.vocab * a.hidden * (1 if a.tied_embeddings else 2) + a.hidden


def total_params(a: Architecture) -> int:
    return a.layers * layer_params(a) + embedding_params(a)


def linear_params_per_layer(a: Architecture) -> int:
    """Weights that bitsandbytes quantizes to 4 bit: the decoder layers' nn.Linear weights (not MoE's 3-D experts)."""
    linears = attention_linears(a) | FAMILIES[a.family].mlp_linears(a)
    return sum(i * o for i, o in linears.values())


def expert_weight_values(a: Architecture) -> int:
    """The experts' weights over all layers (biases not counted): what an MXFP4 checkpoint stores in MXFP4."""
    return a.layers * sum(a.experts * i * o for i, o in FAMILIES[a.family].expert_weights(a).values())
