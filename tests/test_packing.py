"""GPT-OSS rows packed without padding (the recipe's `packing: true`): each conversation attends only to itself, with
its attention sinks and sliding window intact, so a packed batch trains exactly as the same rows padded."""

import torch
from transformers import AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from finetune import patches
from finetune.config.files import read_recipe
from finetune.models import tiny
from tests.helpers import ROOT


def test_the_gpt_oss_recipes_pack_their_rows():
    for recipe in ("gpt-oss-20b/lora.yaml", "gpt-oss-120b/lora.yaml"):
        assert read_recipe(ROOT / "recipes" / recipe).get("packing") is True, recipe


def test_packed_gpt_oss_rows_give_the_padded_rows_loss_and_gradients():
    """On CPU the recipe's flex_attention runs as eager attention (finetune/models/cpu.py), with the same masks."""
    config = tiny.tiny_config("gpt-oss", tiny.build_tiny_tokenizer("gpt-oss"))
    window = config.sliding_window
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    generator = torch.Generator().manual_seed(0)
    # rows longer than the sliding window, of different lengths, so that padding, windows and boundaries all matter
    rows = [torch.randint(5, config.vocab_size, (length,), generator=generator).tolist()
            for length in (3 * window + 5, window - 3, 2 * window + 1)]
    features = [{"input_ids": row} for row in rows]
    padded = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=False)(features)
    packed = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(features)
    assert packed["input_ids"].shape == (1, sum(map(len, rows))) and "attention_mask" not in packed

    results = []
    for batch in (padded, packed):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
        model.train()
        patches.keep_packed_documents_apart(model)
        inputs = {key: value for key, value in batch.items() if key in ("input_ids", "attention_mask", "position_ids",
                                                                          "labels")}
        loss = model(**inputs, use_cache=False).loss  # as TRL trains: with a cache the packed rows are not seen
        loss.backward()
        results.append((loss.detach(), {name: parameter.grad for name, parameter in model.named_parameters()}))
    (padded_loss, padded_grads), (packed_loss, packed_grads) = results
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    for name, gradient in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], gradient, rtol=1e-4, atol=1e-6, msg=name)
    assert any("sinks" in name for name in padded_grads), "the attention sinks take part in the comparison"
