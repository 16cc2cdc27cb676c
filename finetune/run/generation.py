"""After training: load an output folder (a full model, or a LoRA adapter on its base), chat with it, and answer
prompts, one or a file of them in batches. Scoring is finetune/run/evaluation.py's.
"""

import contextlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from finetune import families
from finetune.errors import UserError, first_line, say

SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]*\|>")


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
    from finetune.checks import model_folder
    from finetune.run import model as model_loading

    device = _device(device)
    base = model_folder.check_model(output_dir, flag, base, "--base")
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


def keeps_experts_in_mxfp4(device: str) -> bool:
    """On a GPU an MXFP4 checkpoint's experts stay MXFP4 (GPT-OSS-120B's in bf16 would not fit one GPU) and each layer
    is dequantized as it runs, by the Triton kernel; on a CPU transformers dequantizes them at load instead, as the
    torch reference would do for every layer of every generated token."""
    return device.startswith("cuda")


def load_checked(loadable: Loadable):
    """The model and tokenizer of a model `check_trained` let through."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from finetune.models import expert_lora, mxfp4, mxfp4_loading
    from finetune.run import model as model_loading

    weights, device = loadable.base or loadable.output_dir, loadable.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    kwargs = {"dtype": dtype, "use_safetensors": True}
    mxfp4_base = mxfp4.is_mxfp4_checkpoint(weights)
    resident = mxfp4_base and keeps_experts_in_mxfp4(device)
    if mxfp4_base:
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    try:
        model = mxfp4_loading.load(weights, device, dtype) if resident else \
            AutoModelForCausalLM.from_pretrained(weights, device_map={"": device}, **kwargs)
    except OSError as error:
        raise UserError(
            f"{weights}: the model could not be loaded ({first_line(error)}); without network pass a local "
            f"model folder (--base for an adapter's base model)."
        ) from None
    model_loading.fix_generation_config(model, loadable.tokenizer)
    if loadable.base:
        model = model_loading.load_adapter(model, loadable.output_dir, loadable.base, "--base")
        if resident:  # the expert adapters through the grouped GEMMs: the placeholders cannot take W + B·A
            expert_lora.install(model)
    model_loading.check_finite(model, weights, loadable.output_dir if loadable.base else None)
    model.eval()
    return model, loadable.tokenizer


def answer_text(tokenizer, token_ids, complete: bool = True) -> str:
    """The answer a user sees in generated tokens: up to the end of the turn, without special tokens, and where the
    reply has channels (GPT-OSS's harmony) only the final channel's message (while streaming, nothing until that
    channel starts)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False) if not isinstance(token_ids, str) else token_ids
    for reasoning in families.REASONING_FORMATS:
        if reasoning.channel in text:
            _, found, final = text.rpartition(reasoning.final)
            text = final if found else (text if complete else "")
    ends = [end for reasoning in families.REASONING_FORMATS for end in reasoning.ends] + [tokenizer.eos_token]
    for end in filter(None, ends):
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
    say("chat: type a message; /reset starts a new conversation, /exit quits", stream=sys.stderr)
    for line in _typed_lines(lines or sys.stdin):
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            messages = list(start)
            say("conversation reset", stream=sys.stderr)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        ).to(model.device)
        length, context = inputs["input_ids"].shape[1], context_length(model)
        if context is not None and length >= context:  # the turn is dropped; the conversation goes on without it
            messages.pop()
            say(f"this conversation is {length} tokens with that message and the model reads at most {context}; "
                f"send a shorter one, or /reset to start a new conversation", stream=sys.stderr)
            continue
        new_tokens = generation.get("max_new_tokens", 256)
        if context is not None and length + new_tokens > context:
            say(f"--max_new_tokens {new_tokens} cut to {context - length}: the model reads at most {context} tokens "
                f"and the conversation takes {length}", stream=sys.stderr)
            new_tokens = context - length
        with torch.no_grad():
            output = model.generate(**inputs, streamer=_streamer(tokenizer, out), **no_router_logits(model),
                                    **{**generation, "max_new_tokens": new_tokens})
        reply = answer_text(tokenizer, output[0, inputs["input_ids"].shape[1] :])
        messages.append({"role": "assistant", "content": reply})


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


def no_router_logits(model) -> dict:
    """Mixture-of-experts models trained with TRL's auxiliary loss have `output_router_logits` on in their config;
    generating with it on fails (GPT-OSS computes the loss with the whole attention mask against the last token's
    router logits), and scoring does not need it."""
    return {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}


def context_length(model) -> int | None:
    """The most tokens the model reads, prompt and answer together (its config's max_position_embeddings)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "max_position_embeddings", None)


def generate_answers(model, tokenizer, conversations: list[list[dict]], batch_size: int = 16,
                     chat_template_kwargs: dict | None = None, source: str = "prompts", skip_too_long: bool = False,
                     **generation) -> list[str]:
    """One answer per conversation (its next assistant turn), generated in left-padded batches, greedy by default,
    through the chat template with the values the model was trained with (`chat_template_kwargs`, e.g. GPT-OSS's
    reasoning_effort). Held to the model's context: a prompt that fills it is refused (with `skip_too_long`, answered
    with nothing instead, scored as a miss), and max_new_tokens is cut to what is left of it, each said in one line."""
    generation = {"max_new_tokens": 256, "do_sample": False, "use_cache": True, **no_router_logits(model), **generation}
    context = context_length(model)
    answers, cut_to, skipped = [], None, 0
    was_training = model.training
    model.eval()
    with attention_for_generation(model):
        for start in range(0, len(conversations), batch_size):
            batch = conversations[start : start + batch_size]
            lengths = [len(ids) for ids in tokenizer.apply_chat_template(
                batch, add_generation_prompt=True, tokenize=True, return_dict=True,
                **(chat_template_kwargs or {}))["input_ids"]]
            fits = [context is None or length < context for length in lengths]
            if not all(fits) and not skip_too_long:
                number = start + fits.index(False) + 1
                raise UserError(f"{source}: prompt {number} is {lengths[number - start - 1]} tokens through the chat "
                                f"template and the model reads at most {context} (max_position_embeddings of its "
                                f"config.json); shorten or split that prompt.")
            skipped += fits.count(False)
            kept = [turns for turns, fit in zip(batch, fits) if fit]
            batch_answers = iter(_answer_batch(model, tokenizer, kept, chat_template_kwargs, generation, context)
                                 if kept else [])
            answers += [next(batch_answers) if fit else "" for fit in fits]
            longest = max((length for length, fit in zip(lengths, fits) if fit), default=0)
            if context is not None and kept and generation["max_new_tokens"] > context - longest:
                cut_to = min(cut_to or context, context - longest)
    model.train(was_training)
    if cut_to is not None:
        say(f"{source}: --max_new_tokens {generation['max_new_tokens']} cut to {cut_to} where a prompt leaves less of "
            f"the model's {context}-token context.")
    if skipped:
        say(f"{source}: {skipped} prompt(s) longer than the model's {context}-token context are not answered (scored "
            f"as misses).")
    return answers


def _answer_batch(model, tokenizer, batch: list[list[dict]], chat_template_kwargs: dict | None, generation: dict,
                  context: int | None) -> list[str]:
    """The answers of one batch of prompts that fit the context, new tokens cut to what the longest leaves of it."""
    import torch

    inputs = tokenizer.apply_chat_template(
        batch, add_generation_prompt=True, return_dict=True, return_tensors="pt", padding=True,
        tokenizer_kwargs={"padding_side": "left"}, **(chat_template_kwargs or {}),
    ).to(model.device)
    width = inputs["input_ids"].shape[1]
    if context is not None:
        generation = {**generation, "max_new_tokens": min(generation["max_new_tokens"], context - width)}
    with torch.no_grad():
        output = model.generate(**inputs, **generation)
    return [answer_text(tokenizer, row[width:]) for row in output]


@contextlib.contextmanager
def attention_for_generation(model):
    """Generate with eager attention where the model trains with flex_attention: inductor finds no kernel for flex
    attention's decoding path with GPT-OSS's sinks (torch 2.11 on an H200: NoValidChoicesError at the first
    generate, which stopped the GPT-OSS recipe at its held-out scores before step 1). Eager computes the same
    attention, sinks included; the training's attention is put back after."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    trained_with = getattr(base.config, "_attn_implementation", None)  # private: see finetune/patches.py
    if trained_with != "flex_attention":
        yield
        return
    base.set_attn_implementation("eager")
    try:
        yield
    finally:
        base.set_attn_implementation(trained_with)


def answer(model, tokenizer, prompt: str, max_new_tokens: int = 24, chat_template_kwargs: dict | None = None) -> str:
    """One greedy answer to one user message: what training prints for `sample_prompt` before and after."""
    conversation = [{"role": "user", "content": prompt}]
    return generate_answers(model, tokenizer, [conversation], max_new_tokens=max_new_tokens,
                            chat_template_kwargs=chat_template_kwargs)[0]


def read_prompts(path: str) -> list[tuple[dict, list[dict]]]:
    """(the row to write back, the conversation to answer) for each prompt of a .jsonl (or .json) file of `messages`
    or `prompt` rows (a string or a list of turns, checked as training checks them; a last assistant turn is dropped),
    or of a text file, a line each."""
    from finetune.data import rows as row_checks  # datasets and trl: only for a file of prompts

    file = Path(path)
    if file.is_dir():
        raise UserError(f"{path}: a folder, not a prompts file; pass a .jsonl of `messages` or `prompt` rows, or a "
                        f"text file with one prompt per line.")
    if not file.is_file():
        raise UserError(f"{path}: prompts file not found; pass a .jsonl of `messages` or `prompt` rows, or a text "
                        f"file with one prompt per line.")
    kind = file.suffix.lower()
    if kind in NOT_PROMPT_FILES:
        raise UserError(f"{path}: a {kind} file, which would be read as lines of text; write the prompts as a .jsonl "
                        f"of `messages` or `prompt` rows, or as a text file with one prompt per line.")
    try:
        text = file.read_text(encoding="utf-8-sig")  # a BOM (as Windows editors write one) is not part of line 1
    except UnicodeDecodeError as error:
        line = file.read_bytes()[:error.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line} is not UTF-8 text; save the prompts file as UTF-8.") from None
    except OSError as error:  # no read permission, a broken disk
        raise UserError(f"{path}: the prompts file cannot be read ({error.strerror}); fix its permissions or pass "
                        f"another --prompts.") from None
    if kind not in (".jsonl", ".json"):
        return _text_prompts(path, text)
    prompts = []
    for number, row in _json_rows(path, text, kind):
        turns = row.get("messages", row.get("prompt")) if isinstance(row, dict) else None
        if isinstance(turns, str) and turns.strip():
            turns = [{"role": "user", "content": turns}]
        if isinstance(turns, list) and turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
            turns = turns[:-1]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) and "role" in t for t in turns):
            raise UserError(f"{path}: {number} has no `messages` or `prompt` to answer; give each row "
                            f"{{\"prompt\": \"...\"}} or {{\"messages\": [{{\"role\": \"user\", \"content\": \"...\"}}]}}.")
        problem = row_checks.turns_problem(turns, "messages" if "messages" in row else "prompt")
        if problem:  # a role or content the chat template would render as something else, without a word
            raise UserError(f"{path}: {number} {problem}.")
        prompts.append((row, turns))
    if not prompts:
        raise UserError(f"{path}: holds no prompts; write one prompt per line.")
    return prompts


# Data files that are not prompts a line each: read as text, their lines (a CSV header among them) would be answered
NOT_PROMPT_FILES = (".csv", ".tsv", ".parquet", ".arrow", ".gz", ".zip", ".xz", ".zst", ".bz2")


def _text_prompts(path: str, text: str) -> list[tuple[dict, list[dict]]]:
    prompts = [({"prompt": line.strip()}, [{"role": "user", "content": line.strip()}])
               for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"{path}: holds no prompts; write one prompt per line.")
    return prompts


def _json_rows(path: str, text: str, kind: str):
    """(where, row) of a .jsonl file's lines, or of a .json file's list of rows (or its lines, `datasets`' JSON)."""
    if kind == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError:
            rows = None  # JSON lines in a .json file, as `datasets` reads them too
        if rows is not None:
            rows = rows if isinstance(rows, list) else [rows]
            return [(f"row {number}", row) for number, row in enumerate(rows, start=1)]
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: line {number} is not valid JSON ({error.msg}); fix or remove that "
                            f"line.") from None
    return rows
