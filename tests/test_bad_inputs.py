"""Bad input: recipes, dataset files, config files and flags.

Each case ends in one sentence naming the file, the field and the fix, a non-zero exit, no traceback, no model loaded,
and nothing changed in an output folder that already holds a run. Cases of scripts/sft.py alone run it in this process
(tests/helpers.run_sft_in_process: the same code from the command line on, without paying the imports 40 times), and so
do the cases `finetune launch` refuses before it hands over to accelerate; the cases sft.py finds under a DeepSpeed
config go through the real `accelerate launch` in a subprocess. tests/test_config.py shows the real process once.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import cli
from tests.helpers import ACCELERATE, ROOT, free_port, run_sft_in_process, write

FINETUNE = str(Path(sys.executable).with_name("finetune"))

LORA = ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"
FULL = ROOT / "recipes" / "llama-3.2-1b" / "full.yaml"
TINY = ["--config", str(FULL), "--tiny"]
QLORA = ROOT / "recipes" / "llama-3.2-3b" / "qlora.yaml"
GPT_OSS = ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml"


def with_keys(base: Path, extra: str) -> str:
    """The recipe's text with the keys of `extra` set to its values (a key set twice is refused in its own case)."""
    keys = {line.split(":", 1)[0] for line in extra.splitlines() if ":" in line}
    kept = [line for line in base.read_text().splitlines() if line.split(":", 1)[0] not in keys]
    return "\n".join(kept) + "\n" + extra + "\n"


def recipe_with(tmp_path: Path, base: Path, extra: str) -> Path:
    return write(tmp_path / "recipe.yaml", with_keys(base, extra))


def dataset_file(tmp_path: Path, rows: list) -> Path:
    return write(tmp_path / "rows.jsonl", "".join(json.dumps(row) + "\n" for row in rows))


def good_turns(answer: str = "cold") -> list:
    return [{"role": "user", "content": "What is the opposite of hot?"}, {"role": "assistant", "content": answer}]


def rows_file(tmp: Path, rows: list, name: str = "rows.jsonl") -> Path:
    return write(tmp / name, "".join(row if isinstance(row, str) else json.dumps(row) + "\n" for row in rows))


def write_bytes(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def recipe(tmp: Path, text: str) -> list[str]:
    return ["--config", str(write(tmp / "recipe.yaml", text))]


def data(tmp: Path, rows: list, name: str = "rows.jsonl") -> list[str]:
    return [*TINY, "--dataset_name", str(rows_file(tmp, rows, name))]


def folder(tmp: Path, files: dict) -> list[str]:
    """A data folder of these files (name: text or bytes), trained on with --tiny."""
    for name, content in files.items():
        write_bytes(tmp / "data" / name, content if isinstance(content, bytes) else content.encode())
    return [*TINY, "--dataset_name", str(tmp / "data")]


def user(text: str = "hi") -> dict:
    return {"role": "user", "content": text}


def assistant(text: str = "hello") -> dict:
    return {"role": "assistant", "content": text}


def accelerate_config(tmp: Path, deepspeed: dict | None = None, deepspeed_file: str | None = None) -> Path:
    """A ZeRO-2 accelerate file for one process, pointing at a DeepSpeed JSON written from `deepspeed`."""
    ds_path = deepspeed_file or str(write(tmp / "ds.json", json.dumps(deepspeed) if isinstance(deepspeed, dict) else deepspeed))
    return write(tmp / "accelerate.yaml", (
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        f"  deepspeed_config_file: {ds_path}\n  zero3_init_flag: false\nmachine_rank: 0\nnum_machines: 1\n"
        "num_processes: 1\nuse_cpu: true\n"))


def finetune_launch(config_text: str):
    """A case launched by `finetune launch --config_file` with an accelerate config file of this text."""
    return lambda t: [FINETUNE, "launch", "--config_file", str(write(t / "accelerate.yaml", config_text))]


def run_finetune_launch_in_process(command: list[str], arguments: list[str], capfd, monkeypatch):
    """`finetune launch ...` in this process; handing over to accelerate would fail the test (a refusal comes first)."""
    from finetune.commands import launch as launcher

    def run_and_report(*_):
        raise AssertionError("finetune launch started accelerate instead of refusing the config file")

    monkeypatch.setattr(launcher, "run_and_report", run_and_report)
    capfd.readouterr()
    code = cli.main([*command[1:], *arguments])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(command, code, out, err)


def accelerate_launch(config_builder):
    """A case launched by the real `accelerate launch -q --config_file` with the file the builder writes."""
    def command(t: Path) -> list[str]:
        return [ACCELERATE, "launch", "-q", "--config_file", str(config_builder(t)), "--main_process_port",
                str(free_port())]

    command.starts_a_process = True
    return command


def as_params(cases: list) -> list:
    """A bad-input table as pytest parameters, named by their case, those that start a launcher marked `launches`."""
    return [pytest.param(case, id=case[0], marks=[pytest.mark.launches] if len(case) > 3 and getattr(
        case[3], "starts_a_process", False) else []) for case in cases]


# An FSDP file as `accelerate config` writes it (FSDP version 1)
FSDP_V1 = ("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n"
           "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_sharding_strategy: FULL_SHARD\n"
           "  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_use_orig_params: true\nmachine_rank: 0\n"
           "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 1\nuse_cpu: true\n")
LONG_ROW = {"messages": [user("count " * 200), assistant()]}
DS_AUTO = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto"}

# (name, arguments (a function of tmp_path), words the error sentence must hold[, the launcher: a function of tmp_path;
# default: python scripts/sft.py])
BAD_INPUTS = [
    ("unknown recipe key", lambda tmp: ["--config", str(recipe_with(tmp, FULL, "lerning_rate: 0.1"))],
     ["recipe.yaml", "unknown key `lerning_rate`", "spelling"]),
    ("wrong value type in recipe", lambda tmp: ["--config", str(recipe_with(tmp, LORA, "lora_r: sixteen"))],
     ["recipe.yaml", "`lora_r: sixteen`", "not a valid int"]),
    ("missing recipe file", lambda tmp: ["--config", str(tmp / "nope.yaml")],
     ["nope.yaml", "not found", "--config"]),
    ("broken recipe YAML", lambda tmp: ["--config", str(write(tmp / "broken.yaml", "model_name_or_path: [a, b\n"))],
     ["broken.yaml", "not valid YAML", "line"]),
    ("activation budget above 1", lambda tmp: ["--config", str(FULL), "--tiny", "--activation_memory_budget", "1.5"],
     ["command line (--activation_memory_budget)", "`activation_memory_budget: 1.5`", "at most 1"]),
    ("unknown command-line flag", lambda tmp: ["--config", str(FULL), "--tiny", "--learning_rat", "1"],
     ["command line", "--learning_rat", "spelling"]),
    ("missing dataset file", lambda tmp: ["--config", str(FULL), "--tiny", "--dataset_name", str(tmp / "gone.jsonl")],
     ["gone.jsonl", "not found", "--dataset_name"]),
    ("dataset with no usable column", lambda tmp: ["--config", str(FULL), "--tiny", "--dataset_name",
                                                   str(dataset_file(tmp, [{"question": "a", "answer": "b"}]))],
     ["rows.jsonl", "['question', 'answer']", "`messages`"]),
    ("empty assistant turn", lambda tmp: ["--config", str(FULL), "--tiny", "--dataset_name",
                                          str(dataset_file(tmp, [{"messages": good_turns()}, {"messages": good_turns("  ")}]))],
     ["rows.jsonl", "row 2", "turn 2", "assistant", "empty content"]),
    ("conversation without an assistant turn", lambda tmp: ["--config", str(FULL), "--tiny", "--dataset_name",
                                                            str(dataset_file(tmp, [{"messages": good_turns()[:1]}]))],
     ["rows.jsonl", "row 1", "no assistant turn"]),
    ("LoRA flag on a full fine-tuning recipe", lambda tmp: ["--config", str(FULL), "--tiny", "--lora_r", "8"],
     ["full.yaml", "`lora_r`", "use_peft"]),
    ("expert LoRA on a model without experts",
     lambda tmp: ["--config", str(LORA), "--tiny", "--lora_target_parameters", "mlp.experts.gate_up_proj"],
     ["lora.yaml", "lora_target_parameters", "mixture-of-experts"]),
    ("QLoRA without LoRA", lambda tmp: ["--config", str(QLORA), "--tiny", "--use_peft", "false"],
     ["qlora.yaml", "load_in_4bit", "use_peft: true"]),
    ("missing local model folder", lambda tmp: ["--config", str(FULL), "--model_name_or_path", str(tmp / "no-model")],
     ["no-model", "not found", "--model_name_or_path"]),
    # --- recipes
    ("recipe key misspelled (ModelConfig)", lambda t: ["--tiny", *recipe(t, LORA.read_text() + "\nuse_pft: true\n")],
     ["recipe.yaml", "unknown key `use_pft`", "spelling"]),
    ("recipe key from another tool", lambda t: ["--tiny", *recipe(t, FULL.read_text() + "\nepochs: 3\n")],
     ["recipe.yaml", "unknown key `epochs`", "remove it"]),
    ("float field given a word", lambda t: ["--tiny", *recipe(t, with_keys(FULL, "learning_rate: fast"))],
     ["recipe.yaml", "`learning_rate: fast`", "not a valid float"]),
    ("int field given a float", lambda t: ["--tiny", *recipe(t, FULL.read_text() + "\nmax_steps: 2.5\n")],
     ["recipe.yaml", "`max_steps: 2.5`", "not a valid int"]),
    ("bool field given a word", lambda t: ["--tiny", *recipe(t, FULL.read_text() + "\nuse_peft: maybe\n")],
     ["recipe.yaml", "`use_peft: maybe`", "give it a value of that type"]),
    ("choice field given an unknown value", lambda t: ["--tiny", *recipe(t, with_keys(FULL, "lr_scheduler_type: wiggly"))],
     ["recipe.yaml", "lr_scheduler_type", "wiggly"]),
    ("recipe that is a list", lambda t: [*recipe(t, "- model_name_or_path: x\n- use_peft: true\n")],
     ["recipe.yaml", "YAML mapping", "rewrite"]),
    ("empty recipe file", lambda t: [*recipe(t, "")],
     ["recipe.yaml", "YAML mapping"]),
    ("recipe env that is not a mapping", lambda t: ["--tiny", *recipe(t, FULL.read_text() + "\nenv: [A=1]\n")],
     ["recipe.yaml", "`env`", "mapping"]),
    ("recipe without a model", lambda t: [*recipe(t, f"dataset_name: {ROOT / 'data' / 'sample'}\nuse_peft: false\n")],
     ["recipe.yaml", "`model_name_or_path` is not set", "give a hub id"]),
    ("DoRA on a full fine-tuning recipe", lambda t: [*TINY, "--use_dora", "true"],
     ["full.yaml", "`use_dora`", "use_peft"]),
    ("LoRA dropout on a full fine-tuning recipe", lambda t: ["--tiny", *recipe(t, FULL.read_text() + "\nlora_dropout: 0.1\n")],
     ["recipe.yaml", "`lora_dropout`", "use_peft: true"]),
    # --- numbers out of their range (each a traceback or a run that trained nothing before)
    ("LoRA rank 0", lambda t: ["--config", str(LORA), "--tiny", "--lora_r", "0"], ["command line (--lora_r)", "`lora_r: 0`", "at least 1"]),
    ("LoRA alpha 0", lambda t: ["--config", str(LORA), "--tiny", "--lora_alpha", "0"], ["command line (--lora_alpha)", "`lora_alpha: 0`", "above 0"]),
    ("LoRA dropout above 1", lambda t: ["--config", str(LORA), "--tiny", "--lora_dropout", "1.5"],
     ["command line (--lora_dropout)", "`lora_dropout: 1.5`", "below 1"]),
    ("negative learning rate", lambda t: [*TINY, "--learning_rate=-1e-4"], ["command line (--learning_rate)", "`learning_rate: -0.0001`", "above 0"]),
    ("learning rate NaN", lambda t: [*TINY, "--learning_rate", "nan"], ["command line (--learning_rate)", "`learning_rate: nan`", "finite"]),
    ("max_length 0", lambda t: [*TINY, "--max_length", "0"], ["command line (--max_length)", "`max_length: 0`", "at least 1"]),
    ("max_length -1", lambda t: [*TINY, "--max_length", "-1"], ["command line (--max_length)", "`max_length: -1`", "at least 1"]),
    ("accumulation 0", lambda t: [*TINY, "--gradient_accumulation_steps", "0"],
     ["command line (--gradient_accumulation_steps)", "`gradient_accumulation_steps: 0`", "at least 1"]),
    ("batch 0", lambda t: [*TINY, "--per_device_train_batch_size", "0"], ["command line (--per_device_train_batch_size)", "`per_device_train_batch_size: 0`"]),
    ("negative epochs train nothing", lambda t: [*TINY, "--num_train_epochs", "-1"],
     ["command line (--num_train_epochs)", "`num_train_epochs: -1.0`", "trains nothing"]),
    ("save_steps 0", lambda t: [*TINY, "--save_steps", "0"], ["command line (--save_steps)", "`save_steps: 0.0`", "above 0"]),
    ("recipe key set twice", lambda t: ["--tiny", *recipe(t, FULL.read_text() + "\nlearning_rate: 1.0e-3\n")],
     ["recipe.yaml", "`learning_rate` is set twice", "keep one"]),
    ("recipe that is not UTF-8", lambda t: ["--config", str(write_bytes(t / "recipe.yaml", b"use_peft: true\n\xff: 1\n"))],
     ["recipe.yaml", "not UTF-8", "save the file as UTF-8"]),
    ("output folder under a file", lambda t: [*TINY, "--output_dir", str(write(t / "afile", "x") / "out")],
     ["afile/out", "cannot be created", "is a file"]),
    ("LoRA target that matches no layer", lambda t: ["--config", str(LORA), "--tiny", "--lora_target_modules", "q_proj",
                                                      "v_prj"],
     ["command line (--lora_target_modules)", "`lora_target_modules` ['v_prj'] match no layer", "'v_proj'"]),
    ("save_total_limit 0 (kept every checkpoint)", lambda t: [*TINY, "--save_total_limit", "0"],
     ["command line (--save_total_limit)", "`save_total_limit: 0`", "--save_total_limit None"]),
    ("one name of no layer as the LoRA target", lambda t: ["--config", str(LORA), "--tiny", "--lora_target_modules",
                                                            "q_prj"],
     ["command line (--lora_target_modules)", "['q_prj'] match no layer", "'q_proj'"]),
    ("attention the family cannot use", lambda t: ["--config", str(GPT_OSS), "--tiny", "--attn_implementation",
                                                   "torch_varlen"],
     ["command line (--attn_implementation)", "attention sinks", "flex_attention"]),
    ("mixture naming a missing file under --tiny", lambda t: ["--tiny", *recipe(t, with_keys(
        FULL, f"dataset_mixture: {{datasets: [{{path: {ROOT / 'data' / 'sample' / 'train.jsonl'}}}, "
              f"{{path: {t / 'gone.jsonl'}}}]}}"))],
     ["gone.jsonl", "not found", "`dataset_mixture` entry of", "remove the entry"]),
    ("one step under a warmup trains nothing", lambda t: [*data(t, [{"messages": good_turns()}] * 3),
                                                          "--per_device_train_batch_size", "8", "--warmup_steps", "0.1",
                                                          "--eval_strategy", "no"],
     ["command line (--warmup_steps)", "trains nothing", "pass --warmup_steps 0"]),
    # --- dataset files
    ("bad JSON line", lambda t: data(t, [{"messages": good_turns()}, '{"messages": [oops\n']),
     ["rows.jsonl", "line 2 is not valid JSON", "fix or remove that line"]),
    ("data file that is not UTF-8", lambda t: [*TINY, "--dataset_name", str(write_bytes(t / "rows.jsonl", (
        json.dumps({"messages": good_turns()}) + "\n").encode() + b'{"text": "caf\xe9"}\n'))],
     ["rows.jsonl", "line 2 is not UTF-8", "save the file as UTF-8"]),
    ("empty data file", lambda t: [*TINY, "--dataset_name", str(write(t / "rows.jsonl", "\n"))],
     ["rows.jsonl", "holds no rows"]),
    ("rows of two formats in one file", lambda t: data(t, [{"messages": good_turns()}, {"prompt": "a", "completion": "b"}]),
     ["rows.jsonl", "row 2 has no `messages`", "['completion', 'prompt']", "give every row `messages`"]),
    ("prompt without completion column", lambda t: data(t, [{"prompt": "a"}]),
     ["rows.jsonl", "['prompt']", "`prompt` + `completion`"]),
    ("empty conversation", lambda t: data(t, [{"messages": good_turns()}, {"messages": []}]),
     ["rows.jsonl", "row 2", "empty `messages` list"]),
    ("assistant speaks first", lambda t: data(t, [{"messages": [assistant(), user()]}]),
     ["rows.jsonl", "row 1", "turn 1", "assistant turn after 'start'"]),
    ("two assistant turns in a row", lambda t: data(t, [{"messages": [user(), assistant(), assistant("again")]}]),
     ["rows.jsonl", "row 1", "turn 3", "assistant turn after 'assistant'"]),
    ("unknown role", lambda t: data(t, [{"messages": [{"role": "bot", "content": "x"}, assistant()]}]),
     ["rows.jsonl", "row 1", "role 'bot'", "use one of"]),
    ("content that is not text", lambda t: data(t, [{"messages": [{"role": "user", "content": 7}, assistant()]}]),
     ["rows.jsonl", "row 1", "turn 1"]),
    ("empty text row", lambda t: data(t, [{"text": "ok"}, {"text": "   "}]),
     ["rows.jsonl", "row 2", "empty `text`", "remove the row"]),
    ("empty completion", lambda t: data(t, [{"prompt": "a", "completion": ""}]),
     ["rows.jsonl", "row 1", "empty `completion`"]),
    ("sample longer than max_length with truncation off",
     lambda t: [*data(t, [{"messages": good_turns()}, LONG_ROW]), "--max_length", "64", "--truncation", "false"],
     ["rows.jsonl", "row 2 is", "longer than `max_length: 64`", "truncation: false", "raise max_length"]),
    ("assistant-only loss on plain text rows", lambda t: data(t, [{"text": "The cat sat."}]),
     ["rows.jsonl", "`assistant_only_loss: true`", "set assistant_only_loss: false"]),
    ("unsupported file type", lambda t: [*TINY, "--dataset_name", str(write(t / "rows.txt", "hello\n"))],
     ["rows.txt", "unsupported dataset file type", ".jsonl"]),
    ("one row to train and evaluate on", lambda t: [*data(t, [{"messages": good_turns()}]), "--eval_strategy", "steps"],
     ["rows.jsonl", "one row cannot be split", "eval_strategy: no"]),
    ("train split that does not exist", lambda t: [*data(t, [{"messages": good_turns()}]), "--dataset_train_split", "training"],
     ["rows.jsonl", "no split named `training`", "--dataset_train_split"]),
    ("folder of two data file types", lambda t: folder(t, {"rows.jsonl": json.dumps({"messages": good_turns()}),
                                                           "more.csv": "prompt,completion\na,b\n"}),
     ["data", "several types", "csv (more.csv), json (rows.jsonl)", "keep one type"]),
    ("folder with a line that is not UTF-8", lambda t: folder(t, {"rows.jsonl": b'{"text": "caf\xe9"}\n'}),
     ["data/rows.jsonl", "line 1 is not UTF-8"]),
    ("answer not to be trained (weight 0)", lambda t: data(t, [{"messages": [user(), {**assistant(), "weight": 0}]}]),
     ["rows.jsonl", "row 1 turn 2", "`weight: 0`", "remove that turn or its weight"]),
    ("reasoning trace the chat template leaves out",
     lambda t: data(t, [{"messages": [user(), {**assistant(), "reasoning_content": "think"}]}]),
     ["rows.jsonl", "row 1 turn 2", "`reasoning_content`", "leaves out", "renders no reasoning trace"]),
    ("completion that holds a user turn",
     lambda t: data(t, [{"prompt": [user()], "completion": [user("more"), assistant()]}]),
     ["rows.jsonl", "turn 1 of `completion` is a 'user' turn", "move the rest to `prompt`"]),
    ("tiny width the heads cannot share", lambda t: [*TINY, "--tiny_width", "7"],
     ["full.yaml", "`tiny_width: 7`", "multiple of 8"]),
    # --- config files (through the real launcher)
    ("DeepSpeed JSON batch size contradicts the recipe",
     lambda t: [*TINY, "--per_device_train_batch_size", "8"],
     ["ds.json", "`train_micro_batch_size_per_gpu: 4`", "per_device_train_batch_size: 8", "\"auto\""],
     accelerate_launch(lambda t: accelerate_config(t, {**DS_AUTO, "train_micro_batch_size_per_gpu": 4}))),
    ("DeepSpeed JSON accumulation contradicts the recipe",
     lambda t: [*TINY, "--gradient_accumulation_steps", "1"],
     ["ds.json", "`gradient_accumulation_steps: 8`", "gradient_accumulation_steps: 1"],
     accelerate_launch(lambda t: accelerate_config(t, {**DS_AUTO, "gradient_accumulation_steps": 8}))),
    ("FSDP version 1 file (finetune launch)", lambda t: TINY, ["accelerate.yaml", "FSDP version 1", "accelerate_configs/fsdp.yaml"],
     finetune_launch(FSDP_V1)),
    ("FSDP version 1 file (accelerate launch)", lambda t: TINY,
     ["accelerate.yaml", "FSDP version 1", "accelerate_configs/fsdp.yaml"],
     accelerate_launch(lambda t: write(t / "accelerate.yaml", FSDP_V1))),
    ("no processes in the accelerate file (finetune launch)", lambda t: TINY,
     ["accelerate.yaml", "`num_processes: 0`", "at least 1"],
     finetune_launch((ROOT / "accelerate_configs" / "ddp.yaml").read_text().replace("num_processes: 8", "num_processes: 0"))),
    ("DeepSpeed JSON that is not JSON (finetune launch)", lambda t: TINY, ["ds.json", "not valid JSON", "line"],
     lambda t: [FINETUNE, "launch", "--config_file", str(accelerate_config(t, '{"zero_optimization": {"stage": 2},,}'))]),
    ("DeepSpeed JSON file missing", lambda t: TINY, ["accelerate.yaml", "missing.json", "not found"],
     accelerate_launch(lambda t: accelerate_config(t, deepspeed_file=str(t / "missing.json")))),
    ("accelerate config that is not YAML", lambda t: TINY, ["accelerate.yaml", "not valid YAML at line 2"],
     finetune_launch("distributed_type: [MULTI_GPU\nnum_processes: 2\n")),
    ("unknown distributed type", lambda t: TINY, ["accelerate.yaml", "`distributed_type: MULTI_GPX`", "MULTI_GPU (DDP)"],
     finetune_launch("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPX\nnum_processes: 2\n")),
    ("misspelled accelerate config key", lambda t: TINY, ["accelerate.yaml", "unknown key `num_procesess`", "spelling"],
     finetune_launch("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_procesess: 2\n")),
    ("accelerate config file missing", lambda t: TINY, ["nowhere.yaml", "not found", "accelerate_configs/"],
     lambda t: [FINETUNE, "launch", "--config_file", str(t / "nowhere.yaml")]),
    ("machine rank outside the machines (a hang)", lambda t: TINY, ["`machine_rank: 2`", "ranks 0 to 1", "forever"],
     finetune_launch("distributed_type: MULTI_GPU\nnum_machines: 2\nmachine_rank: 2\nnum_processes: 2\n")),
    ("ZeRO stage 4 in a DeepSpeed JSON", lambda t: TINY, ["ds.json", "`zero_optimization.stage: 4`", "use 2 or 3"],
     lambda t: [FINETUNE, "launch", "--config_file", str(accelerate_config(t, {**DS_AUTO, "zero_optimization": {
         "stage": 4}}))]),
    ("ZeRO stage as text in a DeepSpeed JSON", lambda t: TINY,
     ["ds.json", "`zero_optimization.stage: \"3\"` is text", "without quotes"],
     lambda t: [FINETUNE, "launch", "--config_file", str(accelerate_config(t, {**DS_AUTO, "zero_optimization": {
         "stage": "3"}}))]),
    ("DeepSpeed AutoTP tensor parallelism", lambda t: TINY, ["ds.json", "`tensor_parallel.autotp_size: 4`", "remove"],
     lambda t: [FINETUNE, "launch", "--config_file", str(accelerate_config(t, {**DS_AUTO, "tensor_parallel": {
         "autotp_size": 4}}))]),
    ("DeepSpeed JSON that is a list", lambda t: TINY, ["ds.json", "not a list", "zero_optimization"],
     lambda t: [FINETUNE, "launch", "--config_file", str(accelerate_config(t, "[]"))]),
    # --- flags
    ("flag without its value", lambda t: [*TINY, "--output_dir", str(t / "new"), "--max_steps"],
     ["command line", "--max_steps", "expected one argument", "fix that flag"]),
    ("flag given a word for a number", lambda t: [*TINY, "--per_device_train_batch_size", "eight"],
     ["command line", "--per_device_train_batch_size", "invalid int value: 'eight'", "fix that flag"]),
    ("--config without a path", lambda t: ["--tiny", "--output_dir", str(t / "new"), "--config"],
     ["command line", "--config needs a recipe path"]),
    ("output_dir that is a file", lambda t: [*TINY, "--output_dir", str(write(t / "taken", "a file"))],
     ["taken", "is a file", "--output_dir"]),
    ("resume from a folder that does not exist", lambda t: [*TINY, "--resume_from_checkpoint", str(t / "checkpoint-9")],
     ["checkpoint-9", "does not exist", "--resume_from_checkpoint"]),
    ("resume from a half-written checkpoint",
     lambda t: [*TINY, "--resume_from_checkpoint", str(write(t / "checkpoint-4" / "trainer_state.json", "{}").parent)],
     ["checkpoint-4", "no completeness marker", "--resume_from_checkpoint"]),
]


def run(arguments: list[str], launcher: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, str(ROOT / "scripts" / "sft.py"), *arguments], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=os.environ.copy())


def existing_run(folder: Path, arguments: list[str]) -> Path:
    """An output folder holding a run of the same identity (so that it would be resumed, not refused as another
    run's), with a checkpoint and weights: no bad launch may change a byte of it."""
    from finetune.checks.relaunch import run_identity
    from finetune.errors import UserError
    from finetune.run.arguments import parse_args

    try:
        identity = run_identity(parse_args([*arguments, "--output_dir", str(folder)]))
    except UserError:
        identity = {"model_name_or_path": "meta-llama/Llama-3.2-1B-Instruct", "tiny": True, "use_peft": False,
                    "dataset_name": str(ROOT / "data" / "sample")}
    write(folder / "finetune_run.json", json.dumps(identity, indent=2) + "\n")
    write(folder / "checkpoint-2" / "trainer_state.json", '{"global_step": 2}')
    write(folder / "model.safetensors", "weights")
    return folder


@pytest.mark.parametrize("case", as_params(BAD_INPUTS))
def test_bad_input_is_one_sentence_naming_file_field_and_fix(case, tmp_path, capfd, monkeypatch):
    check_bad_input(case, tmp_path, capfd, monkeypatch)


def output_dir_given(arguments: list[str]) -> Path | None:
    flags = dict(zip(arguments, arguments[1:]))
    return Path(flags["--output_dir"]) if "--output_dir" in flags else None


def folder_state(folder: Path) -> dict | None:
    """Every file (its hash) and folder under `folder`, None when it does not exist: a refusal may not create it,
    nor an empty folder inside it."""
    if not folder.exists():
        return None
    return {str(path.relative_to(folder)): "folder" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
            for path in folder.rglob("*")}


# A field as the sentences name one: `key`, `key: value`, a --flag, or the line of a file
FIELD_NAMED = re.compile(r"`[^`]+`|--\w+|\bline \d+")


def names_the_field(sentence: str) -> bool:
    """The sentence names a field, or opens with the file or folder that is wrong as a whole (missing, damaged, not
    UTF-8, of no readable type, of no model family)."""
    opening = sentence.removeprefix("error: ").split()[0].removesuffix(":")
    return bool(FIELD_NAMED.search(sentence)) or "/" in opening or "." in opening


def check_bad_input(case, tmp_path, capfd, monkeypatch) -> None:
    """One case of a bad-input table (this file's, or another test file's for its own area): (name, build_args,
    expected words[, launcher builder]) ends in a non-zero exit without a traceback, in one sentence that ends in a
    full stop, names a field and gives the fix after a semicolon, with the expected words; no model loaded (in this
    process loading one fails the test: run_sft_in_process) and the output folder byte for byte as it was (an
    existing run's, or the case's own --output_dir, which a refusal may not create)."""
    name, build_args, expected_words, *config = case
    arguments = build_args(tmp_path)
    output_dir = output_dir_given(arguments)
    if output_dir is None:
        output_dir = existing_run(tmp_path / "existing-run", arguments)
        arguments = [*arguments, "--output_dir", str(output_dir)]
    launcher = config[0](tmp_path) if config else None
    before = folder_state(output_dir)
    if launcher is None:
        result = run_sft_in_process(arguments, capfd, monkeypatch)
    elif launcher[0] == FINETUNE:
        result = run_finetune_launch_in_process(launcher, arguments, capfd, monkeypatch)
    else:
        result = run(arguments, launcher)
    check_refusal(result, expected_words, by_accelerate=bool(launcher) and launcher[0] != FINETUNE)
    assert folder_state(output_dir) == before, "a refused run changes nothing in its output folder"


def check_refusal(result: subprocess.CompletedProcess, expected_words: list[str], by_accelerate: bool) -> None:
    """A refusal: non-zero exit without a traceback, one `error:` sentence that ends in a full stop, names a field,
    gives the fix after a semicolon and holds the expected words, and no model loaded."""
    assert result.returncode != 0, result.stdout[-2000:]
    if not by_accelerate:
        assert result.returncode == 2
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
    else:
        # torchrun (which accelerate uses for DeepSpeed even with one process) always ends a failed child with a
        # ChildFailedError traceback of its own; the training process itself must not print one.
        assert not re.search(r'File "[^"]*(finetune/|scripts/sft\.py)', result.stderr), result.stderr[-3000:]
    errors = re.findall(r"error: [^\r\n]*", result.stderr)
    assert len(errors) == 1, result.stderr[-3000:]
    sentence = errors[0].rstrip()
    assert sentence.endswith(".") and "; " in sentence, f"no fix after a semicolon: {sentence}"
    assert names_the_field(sentence), f"no field named: {sentence}"
    for word in expected_words:
        assert word in sentence, f"{word!r} missing from: {sentence}"
    assert "Loading weights" not in result.stderr + result.stdout, "the check must come before the model loads"


@pytest.mark.parametrize("printed", [
    "error: recipe.yaml: `lora_r: 0` is wrong (see the docs).",  # no fix: passed while `or "(" in sentence` was
    "error: the value is wrong; fix it.",  # no field, no file
    "error: recipe.yaml: `lora_r: 0` is wrong; fix it",  # no full stop
])
def test_the_refusal_check_wants_a_field_and_a_fix(printed):
    result = subprocess.CompletedProcess([], 2, "", printed + "\n")
    with pytest.raises(AssertionError):
        check_refusal(result, ["wrong"], by_accelerate=False)
    check_refusal(subprocess.CompletedProcess([], 2, "", "error: recipe.yaml: `lora_r: 0` is wrong; fix it.\n"),
                  ["wrong"], by_accelerate=False)


@pytest.mark.parametrize("arguments, message", [
    (["plan", "--config", str(FULL), "--gpu", "H200", "--gpus", "0"], "argument --gpus: 0 is below 1"),
    (["plan", "--config", str(FULL), "--gpu", "H200", "--nodes", "-2"], "argument --nodes: -2 is below 1"),
    (["plan", "--config", str(FULL), "--gpu-memory", "-1"], "argument --gpu-memory: -1 is out of range"),
    (["eval", "out", "--dataset_name", "rows.jsonl", "--limit", "0"], "argument --limit: 0 is below 1"),
    (["generate", "out", "--prompts", "p.jsonl", "--out", "a.jsonl", "--batch_size", "0"], "argument --batch_size: 0"),
    (["chat", "out", "--temperature", "-1"], "argument --temperature: -1 is out of range"),
    (["chat", "out", "--top_p", "1.5"], "argument --top_p: 1.5 is out of range"),
    (["chat", "out", "--max_new_tokens", "-3"], "argument --max_new_tokens: -3 is below 1"),
], ids=lambda value: value if isinstance(value, str) else " ".join(value[:1] + value[-2:]))
def test_finetune_command_numbers_out_of_range_are_refused_before_anything_runs(arguments, message, capsys):
    """`plan --gpus 0` printed `--num_processes 0`, `eval --limit 0` scored every row, `chat --temperature -1` failed
    in generation: each number is checked where it is parsed."""
    from finetune import cli

    with pytest.raises(SystemExit) as exit:
        cli.main(arguments)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_generate_refuses_a_bad_prompts_file_or_out_folder_before_loading_a_model(tmp_path, capsys, monkeypatch):
    """`generate --out` into a missing folder failed after generating every answer; a prompts file that is not UTF-8
    was a traceback."""
    from finetune.run import generation as inference

    monkeypatch.setattr(inference, "load_trained", lambda *_: pytest.fail("a model was loaded before the refusal"))
    prompts = write(tmp_path / "prompts.txt", "Reverse: dog tree hat\n")
    assert cli.main(["generate", "out", "--prompts", str(prompts), "--out", str(tmp_path / "no" / "a.jsonl")]) == 2
    assert f"its folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    bad = write_bytes(tmp_path / "bad.txt", b"Reverse: dog\nReverse: caf\xe9\n")
    assert cli.main(["generate", "out", "--prompts", str(bad), "--out", str(tmp_path / "a.jsonl")]) == 2
    assert f"{bad}: line 2 is not UTF-8 text" in capsys.readouterr().err


@pytest.mark.launches  # mount
def test_an_output_folder_on_a_read_only_disk_is_refused_before_loading(tmp_path, capfd, monkeypatch):
    """A read-only tmpfs where mounting is allowed (root, as in CI), else os.access answering as on one."""
    disk = tmp_path / "ro"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    if not mounted:
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: False if str(path).startswith(str(disk)) else
                            real_access(path, mode))
    try:
        result = run_sft_in_process([*TINY, "--output_dir", str(disk / "out")], capfd, monkeypatch)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{disk / 'out'}: output_dir cannot be written ({disk} is read-only" in result.stderr, result.stderr
