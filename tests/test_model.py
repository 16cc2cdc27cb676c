"""Model loading seams: the tiny stand-ins keep the real architecture, and the end-of-turn token is trained."""

import json

import pytest
import torch

from finetune.checks import model_folder
from finetune.data import rows as row_checks
from finetune.data.load import load_datasets
from finetune.errors import UserError
from finetune.run import arguments, model
from finetune.run import trainer as training
from tests.helpers import ROOT


def build(recipe: str, tmp_path, *overrides: str):
    run = arguments.parse_args(["--config", str(ROOT / "recipes" / recipe), "--tiny", "--output_dir", str(tmp_path), *overrides])
    model_path = model_folder.resolve_model_path(run)
    tokenizer = model.load_tokenizer(model_path, run.training.assistant_only_loss)
    return run, model_path, tokenizer


@pytest.mark.parametrize("recipe, end_of_turn", [("llama-3.2-1b/lora.yaml", "<|eot_id|>"), ("gpt-oss-20b/lora.yaml", "<|return|>")])
def test_assistant_only_loss_keeps_the_end_of_turn_token_in_the_labels(tmp_path, recipe, end_of_turn):
    run, model_path, tokenizer = build(recipe, tmp_path, "--eval_strategy", "no", "--packing", "false")
    train_set, _ = load_datasets(run.script, run.training)
    trainer = training.build_trainer(run, model.load_model(run, model_path), tokenizer, train_set.select(range(8)), None)
    example = trainer.train_dataset[0]
    trained_ids = [label for label in example["labels"] if label != -100]
    answer = train_set[0]["messages"][-1]["content"]
    assert tokenizer.decode(trained_ids).endswith(answer + end_of_turn)
    assert trained_ids[-1] == tokenizer.convert_tokens_to_ids(end_of_turn)
    assert len(trained_ids) < len(example["input_ids"]) / 2, "the prompt is not trained on"


def test_packed_rows_train_one_end_of_turn_per_conversation_and_no_prompts(tmp_path):
    run, model_path, tokenizer = build("llama-3.2-1b/lora.yaml", tmp_path, "--eval_strategy", "no")
    assert run.training.packing, "the Llama recipes pack rows"
    train_set, _ = load_datasets(run.script, run.training)
    trainer = training.build_trainer(run, model.load_model(run, model_path), tokenizer, train_set.select(range(20)), None)
    example = trainer.train_dataset[0]
    end_of_turn = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    conversations = len(example["seq_lengths"])
    assert conversations > 1
    assert [label for label in example["labels"] if label == end_of_turn] == [end_of_turn] * conversations
    assert example["input_ids"].count(end_of_turn) > conversations, "the prompts' end-of-turn tokens are not trained"


def test_tiny_llama_keeps_grouped_query_attention_and_tied_embeddings(tmp_path):
    run, model_path, _ = build("llama-3.2-1b/full.yaml", tmp_path)
    loaded = model.load_model(run, model_path)
    assert loaded.config.num_key_value_heads < loaded.config.num_attention_heads
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_tiny_gpt_oss_keeps_experts_top2_routing_sinks_and_sliding_layers(tmp_path):
    run, model_path, _ = build("gpt-oss-20b/lora.yaml", tmp_path)
    loaded = model.load_model(run, model_path)
    assert loaded.config.num_local_experts >= 4 and loaded.config.num_experts_per_tok == 2
    assert set(loaded.config.layer_types) == {"sliding_attention", "full_attention"}
    assert all(layer.self_attn.sinks.shape == (loaded.config.num_attention_heads,) for layer in loaded.model.layers)
    assert loaded.dtype == torch.float32, "on CPU the recipe's bf16 becomes float32"


TOKEN_COUNT_ROWS = {
    "messages": [{"messages": [{"role": "user", "content": "hi " * n}, {"role": "assistant", "content": "yo " * n}]}
                 for n in (1, 7, 30)],
    "conversational prompt-completion": [{"prompt": [{"role": "user", "content": "hi " * n}],
                                          "completion": [{"role": "assistant", "content": "yo " * n}]} for n in (2, 9)],
    "prompt-completion": [{"prompt": "hi " * n, "completion": "yo " * n} for n in (3, 11)],
    "text": [{"text": "the cat sat " * n} for n in (1, 13)],
}


@pytest.mark.parametrize("data_format", sorted(TOKEN_COUNT_ROWS))
def test_truncation_off_refuses_exactly_the_rows_trl_would_cut(tmp_path, data_format):
    rows = TOKEN_COUNT_ROWS[data_format]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    conversational = "messages" in rows[0] or isinstance(rows[0].get("prompt"), list)
    run, model_path, tokenizer = build("llama-3.2-1b/lora.yaml", tmp_path / "out", "--eval_strategy", "no",
                                       "--packing", "false", "--dataset_name", str(path), "--max_length", "100000",
                                       "--truncation", "false", "--assistant_only_loss", str(conversational).lower())
    train_set, _ = load_datasets(run.script, run.training)
    trainer = training.build_trainer(run, model.load_model(run, model_path), tokenizer, train_set, None)
    trl_lengths = [len(example["input_ids"]) for example in trainer.train_dataset]
    assert [row_checks._token_count(row, tokenizer) for row in train_set] == trl_lengths
    longest = max(trl_lengths)
    run.training.max_length = longest
    load_datasets(run.script, run.training, tokenizer)
    run.training.max_length = longest - 1
    with pytest.raises(UserError, match=f"row {trl_lengths.index(longest) + 1} is {longest} tokens"):
        load_datasets(run.script, run.training, tokenizer)
    load_datasets(run.script, run.training)  # truncation on: TRL cuts the row, nothing to refuse
