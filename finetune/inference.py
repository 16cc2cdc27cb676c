"""After training: load an output folder (a full model, or a LoRA adapter on its base), chat with it, answer a file of
prompts in batches, and score it on held-out conversations.

Scores, on conversations whose last turn is the assistant's: loss and perplexity on the assistant tokens only (the
tokens TRL's SFTTrainer trains on with `assistant_only_loss`, masked by the same training chat template), and, the
last assistant turn generated greedily from the turns before it, exact match and token-level F1 against it.
"""

import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"
# GPT-OSS's harmony format: the answer is the message of the `final` channel; `analysis` (reasoning) stays hidden.
HARMONY_CHANNEL = "<|channel|>"
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY_ENDS = ("<|return|>", "<|end|>", "<|call|>")
SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]*\|>")
# Generated tokens beyond the longest reference answer: room for a template's channel header and a little more.
ANSWER_SLACK_TOKENS = 32


def _device(device: str | None) -> str:
    """`--device`, checked against this machine before anything loads; by default cuda when there is a GPU."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        wanted = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device}: not a device name; give cpu, cuda or cuda:N.") from None
    if wanted.type == "cpu":
        return device
    here = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if here is None or here.type != wanted.type:
        raise UserError(f"--device {device}: this machine has no {wanted.type} device (it has "
                        f"{here.type if here else 'only the CPU'}); pass --device {here.type if here else 'cpu'}.")
    if wanted.index is not None and wanted.index >= torch.accelerator.device_count():
        raise UserError(f"--device {device}: this machine has {torch.accelerator.device_count()} {wanted.type} "
                        f"devices, numbered from 0; pick one of them.")
    return device


@dataclass
class Loadable:
    """A model checked to load, its tokenizer loaded: what `load_checked` needs, ready before any weights load."""

    output_dir: str
    base: str | None  # the base model of a LoRA adapter
    device: str
    tokenizer: object


def check_trained(output_dir: str, base: str | None = None, device: str | None = None,
                  flag: str = "OUTPUT_DIR") -> Loadable:
    """Refuse what cannot load (model.check_model), a tokenizer without a chat template and a device this machine
    lacks, before any weights load; `flag` names where `output_dir` came from."""
    from finetune import model as model_loading

    device = _device(device)
    base = model_loading.check_model(output_dir, flag, base, "--base")
    tokenizer = model_loading.load_tokenizer(output_dir, assistant_only_loss=True, flag=flag)
    if not tokenizer.chat_template:
        raise UserError(f"{output_dir}: its tokenizer has no chat template, and chat, generate and eval talk to a "
                        f"model through one; give {flag} an instruct model or a trained output folder.")
    return Loadable(output_dir, base, device, tokenizer)


def load_trained(output_dir: str, base: str | None = None, device: str | None = None, flag: str = "OUTPUT_DIR"):
    """The model and tokenizer of a training run's output folder (or of any model folder or hub id), ready to
    generate: bf16 on a GPU, float32 on CPU. A LoRA adapter is loaded on the base model named in its
    adapter_config.json, or on `base`."""
    return load_checked(check_trained(output_dir, base, device, flag))


def load_checked(loadable: Loadable):
    """The model and tokenizer of a model `check_trained` let through."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from finetune import model as model_loading
    from finetune import mxfp4

    weights, device = loadable.base or loadable.output_dir, loadable.device
    kwargs = {"dtype": torch.bfloat16 if device.startswith("cuda") else torch.float32, "use_safetensors": True}
    if mxfp4.is_mxfp4_checkpoint(weights):
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(weights, device_map={"": device}, **kwargs)
    except OSError as error:
        raise UserError(
            f"{weights}: the model could not be loaded ({str(error).splitlines()[0]}); without network pass a local "
            f"model folder (--base for an adapter's base model)."
        ) from None
    model_loading.fix_generation_config(model, loadable.tokenizer)
    if loadable.base:
        model = model_loading.load_adapter(model, loadable.output_dir, loadable.base, "--base")
    model.eval()
    return model, loadable.tokenizer


def answer_text(tokenizer, token_ids, complete: bool = True) -> str:
    """The answer a user sees in generated tokens: up to the end of the turn, without special tokens, and for
    GPT-OSS only the final channel's message (while streaming, nothing until that channel starts)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False) if not isinstance(token_ids, str) else token_ids
    if HARMONY_CHANNEL in text:
        _, found, final = text.rpartition(HARMONY_FINAL)
        text = final if found else (text if complete else "")
    for end in (*HARMONY_ENDS, tokenizer.eos_token or HARMONY_ENDS[0]):
        text = text.split(end, 1)[0]
    return SPECIAL_TOKEN.sub("", text).strip()


def _streamer(tokenizer, out):
    from transformers import TextStreamer

    class AnswerStreamer(TextStreamer):
        """Prints the answer as it is generated, exactly as `answer_text` will return it."""

        def __init__(self):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=False)
            self.raw, self.shown = "", ""

        def on_finalized_text(self, text: str, stream_end: bool = False):
            self.raw += text
            visible = answer_text(tokenizer, self.raw, complete=stream_end)
            if visible.startswith(self.shown):
                out.write(visible[len(self.shown) :])
                self.shown = visible
            out.write("\n" if stream_end else "")
            out.flush()

    return AnswerStreamer()


def generation_kwargs(temperature: float | None, top_p: float | None, max_new_tokens: int) -> dict:
    """Flags left unset keep the model's saved generation config; temperature 0 is greedy."""
    kwargs = {"max_new_tokens": max_new_tokens, "use_cache": True}
    if temperature == 0:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    elif temperature is not None:
        kwargs.update(do_sample=True, temperature=temperature)
    if top_p is not None and temperature != 0:
        kwargs.update(do_sample=True, top_p=top_p)
    return kwargs


def chat(model, tokenizer, system: str | None = None, generation: dict | None = None, lines=None, out=None) -> None:
    """A conversation read line by line (a terminal or a pipe): each line is a user turn whose answer is streamed;
    `/reset` starts a new conversation, `/exit` (or the end of the input) quits."""
    import torch

    out = out or sys.stdout
    generation = generation or {"max_new_tokens": 256}
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    print("[finetune] chat: type a message; /reset starts a new conversation, /exit quits", file=sys.stderr)
    for line in _typed_lines(lines or sys.stdin):
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            messages = list(start)
            print("[finetune] conversation reset", file=sys.stderr, flush=True)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        ).to(model.device)
        with torch.no_grad():
            output = model.generate(**inputs, streamer=_streamer(tokenizer, out), **_no_router_logits(model), **generation)
        answer = answer_text(tokenizer, output[0, inputs["input_ids"].shape[1] :])
        messages.append({"role": "assistant", "content": answer})


def _typed_lines(lines):
    """The lines of a terminal (with a prompt) or a pipe, up to its end. A pipe is decoded a line at a time, so that
    a line that is not UTF-8 is named by its number (a text stream decodes ahead, and fails on an earlier line)."""
    interactive = lines.isatty()
    binary = None if interactive else getattr(lines, "buffer", None)
    number = 0
    while True:
        number += 1
        try:
            line = input("> ") if interactive else (binary.readline().decode() if binary else lines.readline())
        except EOFError:
            return
        except UnicodeDecodeError:
            raise UserError(f"stdin: line {number} is not UTF-8 text; send UTF-8 (convert with iconv -t UTF-8, or "
                            f"set the terminal's encoding to UTF-8).") from None
        if not interactive and not line:
            return
        yield line


def _no_router_logits(model) -> dict:
    """Mixture-of-experts models trained with TRL's auxiliary loss have `output_router_logits` on in their config;
    generating with it on fails (GPT-OSS computes the loss with the whole attention mask against the last token's
    router logits), and scoring does not need it."""
    return {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}


def generate_answers(model, tokenizer, conversations: list[list[dict]], batch_size: int = 16,
                     **generation) -> list[str]:
    """One answer per conversation (its next assistant turn), generated in left-padded batches, greedy by default."""
    import torch

    generation = {"max_new_tokens": 256, "do_sample": False, "use_cache": True, **_no_router_logits(model), **generation}
    answers = []
    was_training = model.training
    model.eval()
    for start in range(0, len(conversations), batch_size):
        texts = [
            tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
            for turns in conversations[start : start + batch_size]
        ]
        inputs = tokenizer(
            texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt"
        ).to(model.device)
        with torch.no_grad():
            output = model.generate(**inputs, **generation)
        answers += [answer_text(tokenizer, row[inputs["input_ids"].shape[1] :]) for row in output]
    model.train(was_training)
    return answers


def read_prompts(path: str) -> list[tuple[dict, list[dict]]]:
    """(the row to write back, the conversation to answer) for each prompt of a .jsonl file of `messages` or
    `prompt` rows (a string or a list of turns; a last assistant turn is dropped), or of a text file, a line each."""
    file = Path(path)
    if file.is_dir():
        raise UserError(f"{path}: a folder, not a prompts file; pass a .jsonl of `messages` or `prompt` rows, or a "
                        f"text file with one prompt per line.")
    if not file.is_file():
        raise UserError(f"{path}: prompts file not found; pass a .jsonl of `messages` or `prompt` rows, or a text "
                        f"file with one prompt per line.")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        line = file.read_bytes()[:error.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line} is not UTF-8 text; save the prompts file as UTF-8.") from None
    except OSError as error:  # no read permission, a broken disk
        raise UserError(f"{path}: the prompts file cannot be read ({error.strerror}); fix its permissions or pass "
                        f"another --prompts.") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if file.suffix != ".jsonl":
            prompts.append(({"prompt": line.strip()}, [{"role": "user", "content": line.strip()}]))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: line {number} is not valid JSON ({error.msg}); fix or remove that line.") from None
        turns = row.get("messages", row.get("prompt")) if isinstance(row, dict) else None
        if isinstance(turns, str) and turns.strip():
            turns = [{"role": "user", "content": turns}]
        if isinstance(turns, list) and turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
            turns = turns[:-1]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) and "role" in t for t in turns):
            raise UserError(f"{path}: line {number} has no `messages` or `prompt` to answer; give each line "
                            f"{{\"prompt\": \"...\"}} or {{\"messages\": [{{\"role\": \"user\", \"content\": \"...\"}}]}}.")
        prompts.append((row, turns))
    if not prompts:
        raise UserError(f"{path}: holds no prompts; write one prompt per line.")
    return prompts


def held_out_conversations(dataset, limit: int | None = None) -> list[list[dict]]:
    """The rows of a `messages` or prompt-completion dataset as conversations ending in an assistant turn."""
    conversations = []
    for row in dataset.select(range(min(limit, len(dataset)))) if limit else dataset:
        if "messages" in row:
            turns = row["messages"]
        elif "prompt" in row and "completion" in row:
            prompt, completion = row["prompt"], row["completion"]
            turns = (prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]) + (
                completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            )
        else:
            continue
        if turns and turns[-1]["role"] == "assistant":
            conversations.append(turns)
    return conversations


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
    marks them, else our Llama 3.2 one or TRL's training variant (None: none exists, and then the loss falls back to
    the last assistant turn). A run with `assistant_only_loss: false` keeps the plain template, so it is looked up
    here too: its held-out scores count the same tokens as `finetune eval`'s."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    from finetune.model import marked_llama_template

    if has_generation_markers(tokenizer.chat_template):
        return tokenizer.chat_template
    try:
        return marked_llama_template(tokenizer.chat_template) or get_training_chat_template(tokenizer)
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


def assistant_loss(model, tokenizer, conversations: list[list[dict]], batch_size: int = 16) -> float:
    """Mean cross-entropy over the assistant tokens of the conversations (the tokens SFT trains on)."""
    import torch

    template = _training_chat_template(tokenizer)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    for start in range(0, len(conversations), batch_size):
        rows = [_labelled(tokenizer, turns, template) for turns in conversations[start : start + batch_size]]
        width = max(len(ids) for ids, _ in rows)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows], device=model.device)
        labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rows], device=model.device)
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows], device=model.device)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention, **_no_router_logits(model)).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
        ).item()
        count += int((labels[:, 1:] != -100).sum())
    model.train(was_training)
    return total / max(count, 1)


def score(model, tokenizer, conversations: list[list[dict]], batch_size: int = 16, max_new_tokens: int = 256) -> dict:
    """Loss and perplexity on the assistant tokens; exact match and token F1 of the regenerated last answer."""
    references = [turns[-1]["content"] for turns in conversations]
    longest = max(len(tokenizer(reference, add_special_tokens=False)["input_ids"]) for reference in references)
    answers = generate_answers(model, tokenizer, [turns[:-1] for turns in conversations], batch_size,
                               max_new_tokens=min(max_new_tokens, longest + ANSWER_SLACK_TOKENS))
    loss = assistant_loss(model, tokenizer, conversations, batch_size)
    return {
        "rows": len(conversations),
        "loss": round(loss, 4),
        "perplexity": round(math.exp(min(loss, 50)), 3),
        "exact_match": round(sum(_normalized(a) == _normalized(r) for a, r in zip(answers, references)) / len(answers), 4),
        "token_f1": round(sum(token_f1(a, r) for a, r in zip(answers, references)) / len(answers), 4),
        "answers": answers,
    }


def summary(scores: dict) -> str:
    return (f"loss {scores['loss']:.3f}  perplexity {scores['perplexity']:.2f}  "
            f"exact match {scores['exact_match']:.3f}  token F1 {scores['token_f1']:.3f}")


def examples(conversations: list[list[dict]], answers_by_model: dict[str, list[str]], count: int | None = None) -> list:
    """Per row: the last user turn, the reference answer and each model's answer."""
    rows = []
    for index, turns in enumerate(conversations[:count]):
        prompt = next((turn["content"] for turn in reversed(turns[:-1]) if turn["role"] == "user"), "")
        rows.append({"prompt": prompt, "reference": turns[-1]["content"],
                     **{name: answers[index] for name, answers in answers_by_model.items()}})
    return rows


SCORES_FILE = "finetune_scores.json"


def _batch_size(model) -> int:
    """`torch_varlen` attention (finetune/attention.py) ignores the padding mask of unpacked rows, right for the
    right-padded rows of training but not for left-padded generation: a model trained with it generates one row at
    a time."""
    from finetune.attention import VARLEN_ATTENTION

    return 1 if getattr(model.config, "_attn_implementation", None) == VARLEN_ATTENTION else 16


def before_after_callback(eval_set, rows: int, tokenizer):
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
                self.scores["before"] = score(model, tokenizer, conversations, _batch_size(model))

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if state.global_step < state.max_steps:  # stopped early (SIGTERM): the run is not finished
                return
            if args.world_size > 1:
                if state.is_world_process_zero:
                    print("[finetune] held-out scores before/after training are computed in single-process runs "
                          "only; score the saved model with `finetune eval OUTPUT_DIR --dataset_name DATA "
                          "--compare BASE_MODEL`.", flush=True)
                return
            self.scores["after"] = score(model, tokenizer, conversations, _batch_size(model))
            self.report(args.output_dir)

        def report(self, output_dir: str) -> None:
            answers = {f"{when} training": result.pop("answers") for when, result in self.scores.items()}
            print(f"[finetune] held-out scores, {len(conversations)} eval rows:", flush=True)
            for when, result in self.scores.items():
                print(f"  {when + ' training:':<17} {summary(result)}", flush=True)
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / SCORES_FILE).write_text(json.dumps(
                {**self.scores, "examples": examples(conversations, answers)}, indent=2, ensure_ascii=False) + "\n")

    return BeforeAfterScores()
