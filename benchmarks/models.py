"""The models and rows both benchmarks train on: the real architectures (finetune/model_configs) or the tiny ones of
`finetune.models.tiny`, with random weights built directly on the device (there is no hub; speed and memory do not depend
on the weights' values), and random token-id rows."""

from __future__ import annotations

import math

import numpy as np
import torch


def family(arch: str) -> str:
    return "gpt-oss" if arch.startswith("gpt-oss") else "llama"


def architecture(arch: str, tokenizer, tiny: bool, layers: int | None = None):
    """The transformers config of `arch` (with `tiny`, its family's tiny model), cut to its first `layers` layers."""
    from finetune.families import load_architecture
    from finetune.models import tiny as tiny_models

    if tiny:
        return tiny_models.tiny_config(family(arch), tokenizer)
    config = load_architecture(arch)
    config.pad_token_id = tokenizer.pad_token_id if config.pad_token_id is None else config.pad_token_id
    if layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    return config


def model_kwargs(config, attn: str, experts: str | None, dtype) -> dict:
    kwargs = {"dtype": dtype, "attn_implementation": attn}
    if experts and config.model_type == "gpt_oss":
        kwargs["experts_implementation"] = experts
    return kwargs


def build_model(config, attn: str, experts: str | None, dtype, device: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, **model_kwargs(config, attn, experts, dtype))
    model.config.use_cache = False
    return model


def flops_per_token(model, config, method: str, seq: int) -> float:
    """README formula: 6N (full) or 4N (LoRA) + 6 * layers * d_attn * seq, N = parameters active per token, the input
    embedding excluded (a lookup) unless tied to the LM head; experts counted top_k / num_experts."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed = base.get_input_embeddings().weight
    tied = base.get_output_embeddings() is not None and base.get_output_embeddings().weight is embed
    n_experts = getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    active = 0.0
    seen = set()
    for name, parameter in base.named_parameters():
        if id(parameter) in seen or "lora_" in name:
            continue
        seen.add(id(parameter))
        if parameter is embed and not tied:
            continue
        count = parameter.numel()
        if n_experts and ".experts." in name:
            count = count * top_k / n_experts
        active += count
    d_attn = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    return (6 if method == "full" else 4) * active + 6 * config.num_hidden_layers * d_attn * seq


def fixed_rows(n_rows: int, seq: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(n_rows, seq)).tolist()


def chat_rows(n_rows: int, vocab: int, seed: int, high: int = 4000) -> list[list[int]]:
    """Rows of log-normal lengths like chat data (median ~550, clipped to [50, 4000]), scaled to at most `high`."""
    lengths = np.random.default_rng(seed).normal(math.log(550), 0.95, size=n_rows)
    lengths = np.maximum(np.clip(np.exp(lengths), 50, 4000).astype(int) * high / 4000, 8).astype(int)
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lengths]


def learnable_rows(n_rows: int, vocab: int, seed: int, low: int = 64, high: int = 1024) -> list[list[int]]:
    """Rows that repeat a short random motif: a model learns them within a few steps, so the loss moves."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_rows):
        motif = rng.integers(0, min(vocab, 4096), size=int(rng.integers(4, 12)))
        length = int(rng.integers(low, high))
        rows.append(np.resize(motif, length).tolist())
    return rows


def markov_rows(n_rows: int, seq: int, vocab: int, seed: int, states: int = 512,
                successors: int = 4) -> list[list[int]]:
    """Rows of `seq` tokens walked on a random Markov chain: each of `states` token ids is followed by one of its
    `successors` ids, with equal odds. A model learns it within a few hundred steps, and its loss has a floor, ln
    `successors` nats per token, so two runs' final losses compare as numbers well above zero. The ids are below 990,
    clear of the tiny tokenizer's special tokens (992 and up), which the real architectures' runs use too."""
    rng = np.random.default_rng(seed)
    tokens = rng.choice(min(vocab, 990), size=states, replace=False)
    following = rng.integers(0, states, size=(states, successors))
    state = rng.integers(0, states, size=n_rows)
    rows = np.empty((n_rows, seq), dtype=np.int64)
    for position in range(seq):
        rows[:, position] = tokens[state]
        state = following[state, rng.integers(0, successors, size=n_rows)]
    return rows.tolist()


def make_dataset(rows):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": rows})
