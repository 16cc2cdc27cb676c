"""Scores of a model on held-out conversations, for `finetune eval` and for the callback that scores a run before
and after training.

On conversations whose last turn is the assistant's: loss and perplexity on the assistant tokens only (the tokens
TRL's SFTTrainer trains on with `assistant_only_loss`, masked by the same training chat template), and, the last
assistant turn generated greedily from the turns before it (finetune/run/generation.py), exact match and token-level F1
against it.
"""

import contextlib
import json
import math
from collections import Counter
from pathlib import Path

from finetune import families
from finetune.data.formats import trl_format
from finetune.errors import say
from finetune.run.generation import attention_for_generation, context_length, generate_answers, no_router_logits

SCORES_FILE = "finetune_scores.json"


# Generated tokens beyond the longest reference answer: room for a template's channel header and a little more.
ANSWER_SLACK_TOKENS = 32


def held_out_conversations(dataset, limit: int | None = None) -> list[list[dict]]:
    """The rows of a `messages` or prompt-completion dataset as conversations ending in an assistant turn."""
    data_format = trl_format(dataset.column_names)
    if data_format not in ("messages", "prompt-completion"):
        return []
    conversations = []
    for row in dataset.select(range(min(limit, len(dataset)))) if limit else dataset:
        if data_format == "messages":
            turns = row["messages"]
        else:
            turns = _as_turns(row["prompt"], "user") + _as_turns(row["completion"], "assistant")
        if turns and turns[-1]["role"] == "assistant":
            conversations.append(turns)
    return conversations


def _as_turns(value, role: str) -> list[dict]:
    """A prompt or completion: a list of turns already, or the text of one turn."""
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def _normalized(text: str) -> str:
    return " ".join(text.split())


def token_f1(answer: str, reference: str) -> float:
    """F1 of the whitespace-separated tokens the answer shares with the reference (SQuAD's token F1, case kept)."""
    common = sum((Counter(answer.split()) & Counter(reference.split())).values())
    if common == 0:
        return float(answer.split() == reference.split())
    precision, recall = common / len(answer.split()), common / len(reference.split())
    return 2 * precision * recall / (precision + recall)


def _training_chat_template(tokenizer) -> str | None:
    """The template SFTTrainer masks assistant tokens with under `assistant_only_loss`: the tokenizer's own when it
    marks them, else a family's marked copy (finetune/families.py) or TRL's training variant (None: none exists, and
    then the loss falls back to the last assistant turn). A run with `assistant_only_loss: false` keeps the plain
    template, so it is looked up here too: its held-out scores count the same tokens as `finetune eval`'s."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(tokenizer.chat_template):
        return tokenizer.chat_template
    try:
        return families.training_chat_template(tokenizer.chat_template) or get_training_chat_template(tokenizer)
    except ValueError:  # TRL knows no training variant of this template
        return None


def _labelled(tokenizer, turns: list[dict], template: str | None) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 outside the assistant's tokens) as SFTTrainer builds them."""
    if template is not None:
        encoded = tokenizer.apply_chat_template(
            turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=template
        )
        ids = list(encoded["input_ids"])
        return ids, [token if keep else -100 for token, keep in zip(ids, encoded["assistant_masks"])]
    from trl.data_utils import common_prefix_length

    prompt = tokenizer.apply_chat_template(turns[:-1], tokenize=True, add_generation_prompt=True, return_dict=True)
    ids = list(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True)["input_ids"])
    start = common_prefix_length(list(prompt["input_ids"]), ids)
    return ids, [-100] * start + ids[start:]


def assistant_loss(model, tokenizer, conversations: list[list[dict]], batch_size: int = 16,
                   max_length: int | None = None) -> float:
    """Mean cross-entropy over the assistant tokens of the conversations (the tokens SFT trains on), each row cut to
    its first `max_length` tokens as training cuts it (by default to the model's context)."""
    import torch

    template = _training_chat_template(tokenizer)
    limit = max_length or context_length(model)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    for start in range(0, len(conversations), batch_size):
        rows = [(ids[:limit], labels[:limit]) for ids, labels in
                (_labelled(tokenizer, turns, template) for turns in conversations[start : start + batch_size])]
        width = max(len(ids) for ids, _ in rows)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows], device=model.device)
        labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rows], device=model.device)
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows], device=model.device)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention, **no_router_logits(model)).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
        ).item()
        count += int((labels[:, 1:] != -100).sum())
    model.train(was_training)
    return total / max(count, 1)


@contextlib.contextmanager
def trained_weights_in_model_dtype(model):
    """TRL keeps a quantized model's trained weights in bf16 (QLoRA's recommendation) whatever dtype the model runs in
    (float32 on CPU, float16 where a recipe asks for it). LoRA layers cast their inputs, but a whole module trained as a
    copy (`modules_to_save`, axolotl's `lora_modules_to_save: [lm_head]`) would take the model's activations with bf16
    weights, which only TRL's fused training loss casts: generation and the scoring forward stop on a dtype mismatch.
    While scoring, those weights are held in the dtype of the model's other weights; the trained tensors are put back
    after, untouched."""
    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    model_dtype = model.config.dtype
    recast = [parameter for parameter in model.parameters()
              if quantized and parameter.requires_grad and parameter.is_floating_point()
              and parameter.dtype != model_dtype]
    trained = [parameter.data for parameter in recast]
    for parameter in recast:
        parameter.data = parameter.data.to(model_dtype)
    try:
        yield
    finally:
        for parameter, tensor in zip(recast, trained):
            parameter.data = tensor


def score(model, tokenizer, conversations: list[list[dict]], batch_size: int = 16, max_new_tokens: int = 256,
          max_length: int | None = None, source: str = "held-out rows") -> dict:
    """Loss and perplexity on the assistant tokens of rows cut to `max_length` as training cuts them; exact match and
    token F1 of the regenerated last answer (a row whose prompt exceeds the model's context scores as a miss)."""
    references = [turns[-1]["content"] for turns in conversations]
    longest = max(len(tokenizer(reference, add_special_tokens=False)["input_ids"]) for reference in references)
    # The loss's forward too: flex's kernels fail on GPT-OSS's sinks there, and bf16 copies on a float32 model.
    with attention_for_generation(model), trained_weights_in_model_dtype(model):
        answers = generate_answers(model, tokenizer, [turns[:-1] for turns in conversations], batch_size,
                                   source=source, skip_too_long=True,
                                   max_new_tokens=min(max_new_tokens, longest + ANSWER_SLACK_TOKENS))
        loss = assistant_loss(model, tokenizer, conversations, batch_size, max_length)
    return {
        "rows": len(conversations),
        "loss": round(loss, 4),
        "perplexity": round(math.exp(min(loss, 50)), 3),
        "exact_match": round(sum(_normalized(a) == _normalized(r) for a, r in zip(answers, references))
                             / len(answers), 4),
        "token_f1": round(sum(token_f1(a, r) for a, r in zip(answers, references)) / len(answers), 4),
        "answers": answers,
    }


def summary(scores: dict) -> str:
    return (f"loss {scores['loss']:.3f}  perplexity {scores['perplexity']:.2f}  "
            f"exact match {scores['exact_match']:.3f}  token F1 {scores['token_f1']:.3f}")


def examples(conversations: list[list[dict]], answers_by_model: dict[str, list[str]],
             count: int | None = None) -> list:
    """Per row: the last user turn, the reference answer and each model's answer."""
    rows = []
    for index, turns in enumerate(conversations[:count]):
        prompt = next((turn["content"] for turn in reversed(turns[:-1]) if turn["role"] == "user"), "")
        rows.append({"prompt": prompt, "reference": turns[-1]["content"],
                     **{name: answers[index] for name, answers in answers_by_model.items()}})
    return rows


def _batch_size(model) -> int:
    """`torch_varlen` attention (finetune/models/attention.py) ignores the padding mask of unpacked rows, right for the
    right-padded rows of training but not for left-padded generation: a model trained with it generates one row at
    a time."""
    from finetune.models.attention import VARLEN_ATTENTION

    return 1 if getattr(model.config, "_attn_implementation", None) == VARLEN_ATTENTION else 16


def before_after_callback(eval_set, rows: int, tokenizer, max_length: int | None):
    """A callback scoring up to `rows` held-out conversations when training starts (not on resume) and ends, or
    None when there is nothing to score. Only a single process scores: generating under ZeRO-3 or FSDP would need
    every rank to take part, so multi-process runs print how to score afterwards instead."""
    from transformers import TrainerCallback

    conversations = held_out_conversations(eval_set, rows) if eval_set is not None and rows > 0 else []
    if not conversations:
        return None

    class BeforeAfterScores(TrainerCallback):
        def __init__(self):
            self.scores = {}

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if args.world_size == 1 and state.global_step == 0:
                self.scores["before"] = score(model, tokenizer, conversations, _batch_size(model),
                                              max_length=max_length)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if state.global_step < state.max_steps:  # stopped early (SIGTERM): the run is not finished
                return
            if args.world_size > 1:
                if state.is_world_process_zero:
                    say("held-out scores before/after training are computed in single-process runs "
                        "only; score the saved model with `finetune eval OUTPUT_DIR --dataset_name DATA "
                        "--compare BASE_MODEL`.")
                return
            self.scores["after"] = score(model, tokenizer, conversations, _batch_size(model), max_length=max_length)
            self.report(args.output_dir)

        def report(self, output_dir: str) -> None:
            answers = {f"{when} training": result.pop("answers") for when, result in self.scores.items()}
            say(f"held-out scores, {len(conversations)} eval rows:")
            for when, result in self.scores.items():
                print(f"  {when + ' training:':<17} {summary(result)}", flush=True)
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / SCORES_FILE).write_text(json.dumps(
                {**self.scores, "examples": examples(conversations, answers)}, indent=2, ensure_ascii=False) + "\n")

    return BeforeAfterScores()
