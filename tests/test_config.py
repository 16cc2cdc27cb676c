"""A refusal as a real process shows it (one line, exit code 2), output folders that hold other files, and the CPU's
changes to a recipe. The table of bad inputs is in tests/test_bad_inputs.py."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ACCELERATE, ROOT, folder_digest, free_port, run_sft_in_process, write

LLAMA_FULL = ROOT / "recipes" / "llama-3.2-1b" / "full.yaml"
LLAMA_LORA = ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"
QLORA = ROOT / "recipes" / "llama-3.2-3b" / "qlora.yaml"
LLAMA_3B_LORA = ROOT / "recipes" / "llama-3.2-3b" / "lora.yaml"


def run_sft(*args: str, launcher: tuple[str, ...] = (sys.executable,)) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*launcher, str(ROOT / "scripts" / "sft.py"), *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ.copy(),
    )




@pytest.mark.launches
def test_a_refusal_in_a_real_process_is_one_line_and_exit_code_2(tmp_path):
    result = run_sft("--config", str(LLAMA_FULL), "--tiny", "--learning_rat", "1", "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: command line: unknown flag --learning_rat; check its spelling with `scripts/sft.py --help`.")


def test_output_dir_holding_foreign_files_is_refused_and_left_untouched(tmp_path, capfd, monkeypatch):
    output_dir = tmp_path / "out"
    write(output_dir / "model.safetensors", "someone else's weights")
    write(output_dir / "notes" / "readme.txt", "keep me")
    before = folder_digest(output_dir)
    result = run_sft_in_process(["--config", str(LLAMA_FULL), "--tiny", "--output_dir", str(output_dir)], capfd, monkeypatch)
    assert result.returncode == 2
    assert str(output_dir) in result.stderr and "no finetune run wrote" in result.stderr and "--output_dir" in result.stderr
    assert folder_digest(output_dir) == before


@pytest.mark.launches
def test_output_dir_of_another_run_is_refused_and_left_untouched(tmp_path, capfd, monkeypatch):
    output_dir = tmp_path / "out"
    first = run_sft("--config", str(LLAMA_LORA), "--tiny", "--output_dir", str(output_dir), "--max_steps", "1",
                    "--eval_strategy", "no", "--report_to", "none")
    assert first.returncode == 0, first.stderr[-2000:]
    before = folder_digest(output_dir)
    second = run_sft_in_process(["--config", str(LLAMA_FULL), "--tiny", "--output_dir", str(output_dir)], capfd, monkeypatch)
    assert second.returncode == 2
    assert "holds another run (use_peft was True, now False)" in second.stderr
    assert folder_digest(output_dir) == before


@pytest.mark.launches
def test_qlora_under_a_sharding_config_is_refused_by_the_real_launcher(tmp_path):
    result = run_sft(
        "--config", str(QLORA), "--tiny", "--output_dir", str(tmp_path / "out"),
        launcher=(ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml"),
                  "--num_processes", "2", "--main_process_port", str(free_port())),
    )
    assert result.returncode != 0
    assert "error: " in result.stderr and "fsdp.yaml: QLoRA's 4-bit weights cannot be sharded by FSDP" in result.stderr
    assert "accelerate_configs/ddp.yaml" in result.stderr
    assert "Loading weights" not in result.stderr + result.stdout


def test_on_cpu_the_recipe_compiles_nothing_unless_the_command_line_asks_and_the_warning_says_which(capsys):
    from finetune.run.arguments import parse_args

    recipe = str(ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml")
    capsys.readouterr()
    assert not parse_args(["--config", recipe, "--tiny"]).training.torch_compile
    assert "'torch_compile': False" in capsys.readouterr().out
    assert parse_args(["--config", recipe, "--tiny", "--torch_compile", "true"]).training.torch_compile
    said = capsys.readouterr().out
    assert "[finetune] No GPU" in said and "torch_compile" not in said


def test_lora_target_parameters_none_on_the_command_line_turns_expert_lora_off():
    from finetune.run.arguments import parse_args

    recipe = str(ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml")
    assert parse_args(["--config", recipe, "--tiny"]).model.lora_target_parameters == [
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert parse_args(["--config", recipe, "--tiny", "--lora_target_parameters", "none"]).model.lora_target_parameters is None


def test_on_cpu_a_recipe_s_activation_offloading_is_off_and_the_flag_is_refused(tmp_path, capsys):
    import pytest

    from finetune.checks.recipe import check
    from finetune.errors import UserError
    from finetune.run.arguments import parse_args

    recipe = tmp_path / "offloaded.yaml"
    recipe.write_text((ROOT / "recipes/llama-3.2-3b/lora.yaml").read_text().replace("activation_offloading: false",
                                                                                   "activation_offloading: true"))
    capsys.readouterr()
    run = parse_args(["--config", str(recipe), "--tiny", "--output_dir", str(tmp_path / "out")])
    assert not run.training.activation_offloading and "'activation_offloading': False" in capsys.readouterr().out
    check(run)
    flagged = parse_args(["--config", str(recipe), "--tiny", "--output_dir", str(tmp_path / "out"),
                          "--activation_offloading", "true"])
    with pytest.raises(UserError, match="--activation_offloading true.*no GPU; drop the flag"):
        check(flagged)


def test_the_activation_budget_reaches_inductor_only_for_layers_compiled_without_checkpointing(tmp_path, monkeypatch):
    """The 3B LoRA recipe's 0.8 (it saved 14 GiB on an H200); checkpointed layers keep only their inputs, and with 0.5
    they peaked higher (10.2 GiB against 9.4), so there the recipe's value is not applied."""
    from torch._functorch import config as functorch_config

    from finetune.models import cpu
    from finetune.run.arguments import apply_to_process, parse_args

    monkeypatch.setattr(functorch_config, "activation_memory_budget", 1.0)
    monkeypatch.setattr(cpu, "prepare_cpu_process_group", lambda: None)
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "true")
    for flags, budget in ((["--torch_compile", "true"], 0.8),
                          (["--torch_compile", "true", "--gradient_checkpointing", "true"], 1.0),
                          ([], 1.0)):  # on a CPU the recipe compiles nothing
        functorch_config.activation_memory_budget = 1.0
        apply_to_process(parse_args(["--config", str(LLAMA_3B_LORA), "--tiny", *flags,
                                     "--output_dir", str(tmp_path / "out")]))
        assert functorch_config.activation_memory_budget == budget, flags


NUMBERS_REFUSED_BEFORE_LOADING = [
    # (flags, the words of the one sentence): each ended in a traceback after loading, or trained something else
    (["--max_steps", "0"], "`max_steps: 0` must be above 0, or -1 to train num_train_epochs"),
    (["--max_steps", "-5"], "`max_steps: -5` must be above 0"),
    (["--warmup_steps", "nan"], "`warmup_steps: nan` must be a finite number"),
    (["--weight_decay", "nan"], "`weight_decay: nan` must be a finite number"),
    (["--max_grad_norm", "nan"], "`max_grad_norm: nan` must be a finite number"),
    (["--max_grad_norm", "-1"], "`max_grad_norm: -1.0` must be 0 or more"),
    (["--eval_samples_before_after", "-1"], "`eval_samples_before_after: -1` must be 0"),
    (["--adam_epsilon", "-1"], "`adam_epsilon: -1.0` must be above 0"),
    (["--adam_beta2", "1"], "`adam_beta2: 1.0` is a decay rate"),
    (["--dataset_num_proc", "-1"], "`dataset_num_proc: -1` must be at least 1"),
    (["--logging_steps", "-1"], "`logging_steps: -1.0` must be above 0"),
    # issue 37: tracebacks after loading, or silently kept, before every numeric field had a range
    (["--seed", "-5"], "`seed: -5` seeds numpy"),
    (["--dataloader_num_workers", "-1"], "`dataloader_num_workers: -1` must be 0"),
    (["--eval_accumulation_steps", "0"], "`eval_accumulation_steps: 0` must be a whole number of at least 1"),
    (["--logging_steps", "nan"], "`logging_steps: nan` must be a finite number"),
    (["--save_steps", "inf"], "`save_steps: inf` must be a finite number"),
    (["--save_total_limit", "-3"], "`save_total_limit: -3` must be at least 1"),
    (["--label_smoothing_factor", "2"], "`label_smoothing_factor: 2.0` is a probability"),
    (["--lr_scheduler_kwargs", "power"], "`lr_scheduler_kwargs: power` must be a mapping"),
    (["--lr_scheduler_kwargs", "{power: 2}"], "--lr_scheduler_kwargs {power: 2} is not valid JSON"),
    (["--lr_scheduler_kwargs={power: 2}"], "--lr_scheduler_kwargs {power: 2} is not valid JSON"),
    (["--attn_implementation", "flashy"], "`attn_implementation: flashy` is not an attention transformers knows"),
    (["--optim", "lomo"], "`optim: lomo` needs a package that is not installed (You need to install `lomo_optim`"),
]


@pytest.mark.parametrize("flags, sentence", NUMBERS_REFUSED_BEFORE_LOADING, ids=[" ".join(f) for f, _ in
                                                                                  NUMBERS_REFUSED_BEFORE_LOADING])
def test_numbers_and_mappings_that_would_fail_after_loading_are_refused_in_one_sentence(flags, sentence, tmp_path):
    from finetune.checks.recipe import check
    from finetune.errors import UserError
    from finetune.run.arguments import parse_args

    with pytest.raises(UserError) as refused:
        check(parse_args(["--config", str(LLAMA_LORA), "--tiny", "--output_dir", str(tmp_path / "out"), *flags]))
    from finetune.config import numbers

    # a number, a mapping or an attention given as a flag is named as coming from the flag, not from the recipe
    named = {*numbers.RANGED_KEYS, *numbers.MAPPING_FIELDS, "attn_implementation"}
    source = f"command line ({flags[0]})" if flags[0][2:] in named and "JSON" not in sentence else str(LLAMA_LORA)
    assert sentence in str(refused.value) and str(refused.value).startswith(source), str(refused.value)


def test_the_values_next_to_those_refused_still_run(tmp_path):
    from finetune.checks.recipe import check
    from finetune.run.arguments import parse_args

    for flags in (["--max_steps", "-1"], ["--warmup_steps", "0.1"], ["--max_grad_norm", "0"],
                  ["--lr_scheduler_kwargs", '{"power": 2}'], ["--attn_implementation", "sdpa"],
                  ["--attn_implementation", "kernels-community/vllm-flash-attn3"]):
        check(parse_args(["--config", str(LLAMA_LORA), "--tiny", "--output_dir", str(tmp_path / "out"), *flags]))
