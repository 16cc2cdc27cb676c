"""Accelerate config files and DeepSpeed JSONs from TRL, accelerate's examples, alignment-handbook and axolotl, as
their repositories ship them (tests/data/external/configs/README.md): each runs as it says, or is refused in one
sentence before the model loads, under `finetune launch` and `accelerate launch` alike.

A file meets two checks (finetune/checks/launch.py): `finetune launch` reads it before handing over to accelerate,
and every training process reads it again from its launcher's command line and compares it with the recipe. Both run
here in this process, the second given the command line an `accelerate launch` would have had; the DeepSpeed JSONs
meet `recipe_checks.check_deepspeed_agrees`. One real `accelerate launch` (TRL's single_gpu.yaml) shows a training process
finding its launcher's file, saying what it ignores, and naming the optimizer and schedule that run; TRL's files for
several GPUs (DDP, FSDP2, ZeRO-3) train two CPU processes for real (about 30-90 s each).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.checks import model_folder
from finetune.checks import recipe as recipe_checks
from finetune.run import arguments, saving
from tests.helpers import ACCELERATE, ROOT, free_port, printed_setup, write
from tests.test_bad_inputs import FINETUNE, FULL, TINY, accelerate_config, check_bad_input

CONFIGS = ROOT / "tests" / "data" / "external" / "configs"
TRL = CONFIGS / "trl" / "trl" / "accelerate_configs"
TRL_EXAMPLES = CONFIGS / "trl" / "examples" / "accelerate_configs"
TEMPLATES = CONFIGS / "accelerate" / "examples" / "config_yaml_templates"
DEEPSPEED_TEMPLATES = CONFIGS / "accelerate" / "examples" / "deepspeed_config_templates"
ALST = CONFIGS / "accelerate" / "examples" / "alst_ulysses_sequence_parallelism"
ND_PARALLEL = CONFIGS / "accelerate" / "examples" / "torch_native_parallelism" / "configs"
HANDBOOK = CONFIGS / "alignment-handbook" / "recipes" / "accelerate_configs"
AXOLOTL = CONFIGS / "axolotl" / "deepspeed_configs"
SCRIPT = str(ROOT / "scripts" / "sft.py")


def derived(tmp: Path, source: Path, change) -> Path:
    """A user's edit of an external file: `change` turns its mapping into the one written (it keeps its name)."""
    import yaml

    return write(tmp / source.name, yaml.safe_dump(change(yaml.safe_load(source.read_text()))))


def without_parallelism(values: dict) -> dict:
    return {key: value for key, value in values.items() if key != "parallelism_config"}


# (name, the config file (a function of tmp_path), words of the one sentence, extra launcher flags). Each is refused
# by `finetune launch` before it starts accelerate, and by the training process an `accelerate launch` starts.
REFUSED_BEFORE_LAUNCH = [
    ("TRL context parallelism", lambda t: TRL_EXAMPLES / "context_parallel_2gpu.yaml",
     ["context_parallel_2gpu.yaml", "`parallelism_config_cp_size: 2`", "context parallelism", "SDPA",
      "remove the parallelism_config block", "accelerate_configs/fsdp.yaml"], []),
    ("TRL ALST/Ulysses sequence parallelism", lambda t: TRL_EXAMPLES / "alst_ulysses_4gpu.yaml",
     ["alst_ulysses_4gpu.yaml", "`parallelism_config_sp_size: 2`", "ALST/Ulysses", "accelerate_configs/zero3.yaml"], []),
    ("accelerate 8-way context parallelism", lambda t: ND_PARALLEL / "cp.yaml",
     ["cp.yaml", "`parallelism_config_cp_size: 8`", "context parallelism"], []),
    ("accelerate tensor parallelism with HSDP", lambda t: ND_PARALLEL / "tp_hsdp.yaml",
     ["tp_hsdp.yaml", "`parallelism_config_tp_size: 2`", "tensor parallelism"], []),
    ("accelerate FP8 (Transformer Engine)", lambda t: TEMPLATES / "fp8.yaml",
     ["fp8.yaml", "`mixed_precision: fp8`", "accelerate's FP8 (TE)", "`fp8: true` in the recipe"], []),
    ("accelerate Intel XPUs", lambda t: TEMPLATES / "multi_xpu.yaml",
     ["multi_xpu.yaml", "`distributed_type: MULTI_XPU`", "MULTI_GPU (DDP), FSDP or DEEPSPEED"], []),
    ("TRL single GPU asked for 2 processes", lambda t: TRL / "single_gpu.yaml",
     ["single_gpu.yaml", "`--num_processes 2` starts one process under `distributed_type: NO`",
      "accelerate_configs/ddp.yaml"], ["--num_processes", "2"]),
    ("accelerate multi-GPU file turned MULTI_CPU", lambda t: derived(t, TEMPLATES / "multi_gpu.yaml", lambda v: {
        **v, "distributed_type": "MULTI_CPU"}),
     ["multi_gpu.yaml", "`num_processes: 2` starts one process under `distributed_type: MULTI_CPU`", "mpirun",
      "accelerate_configs/ddp.yaml"], []),
    ("FSDP2 offloading to the CPU on a machine without a GPU", lambda t: derived(t, TRL / "fsdp2.yaml", lambda v: {
        **v, "fsdp_config": {**v["fsdp_config"], "fsdp_offload_params": True}}),
     ["fsdp2.yaml", "`fsdp_offload_params: true` moves FSDP2's parameters out of GPU memory", "set it to false"], []),
    ("context parallelism renamed without its prefix",
     lambda t: derived(t, TRL_EXAMPLES / "context_parallel_2gpu.yaml", lambda v: {
         **v, "parallelism_config": {"cp_size": 2}}),
     ["context_parallel_2gpu.yaml", "`cp_size` under parallelism_config is not a field accelerate reads",
      "`parallelism_config_cp_size`"], []),
    ("FSDP2 shards over fewer processes than launched",
     lambda t: derived(t, TRL_EXAMPLES / "context_parallel_2gpu.yaml", lambda v: {
         **v, "parallelism_config": {**v["parallelism_config"], "parallelism_config_cp_size": 1}}),
     ["context_parallel_2gpu.yaml", "`parallelism_config_dp_shard_size: 1` does not match the 2 processes"], []),
    ("accelerate two-machine template given a rank beyond its machines (a hang)",
     lambda t: derived(t, TEMPLATES / "multi_node.yaml", lambda v: {**v, "machine_rank": 2}),
     ["multi_node.yaml", "`machine_rank: 2` is not one of the 2 machines launched", "forever"], []),
    ("DeepSpeedExamples' AutoTP JSON (tensor_parallel/hf_integration), its optimizer and scheduler removed",
     lambda t: accelerate_config(t, AUTOTP_JSON), ["ds.json", "`tensor_parallel.autotp_size: 4`", "AutoTP"], []),
    ("axolotl's ZeRO-3 JSON with its stage written as text",
     lambda t: accelerate_config(t, {**json.loads((AXOLOTL / "zero3.json").read_text()), "zero_optimization": {
         **json.loads((AXOLOTL / "zero3.json").read_text())["zero_optimization"], "stage": "3"}}),
     ["ds.json", "`zero_optimization.stage: \"3\"` is text", "without quotes"], []),
    ("accelerate DeepSpeed template with its mixed_precision line uncommented",
     lambda t: derived(t, TEMPLATES / "deepspeed.yaml", lambda v: {**v, "mixed_precision": "bf16", "deepspeed_config": {
         **v["deepspeed_config"], "deepspeed_config_file": str(DEEPSPEED_TEMPLATES / "zero_stage1_config.json")}}),
     ["deepspeed.yaml", "`mixed_precision` cannot be set beside `deepspeed_config_file", "remove it"], []),
]


# deepspeedai/DeepSpeedExamples training/tensor_parallel/hf_integration/configs/ds_config.json (commit ff01ee0), as it
# is but for its optimizer and scheduler blocks, which are refused first
AUTOTP_JSON = {
    "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2, "gather_16bit_weights_on_model_save": True},
    "tensor_parallel": {"autotp_size": 4}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "steps_per_print": 1, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False}


def finetune_launch_of(config_file, flags: list[str]):
    return lambda t: [FINETUNE, "launch", "--config_file", str(config_file(t)), *flags]


def launched_by_accelerate(monkeypatch, config_file: Path, flags: list[str] = ()) -> None:
    """This process as a training process of `accelerate launch --config_file FILE FLAGS scripts/sft.py`, in a world
    of the processes the file asks for (not in WORLD_SIZE: this process would then wait for the others to join)."""
    import yaml

    from finetune.checks import launch as accelerate_checks

    from finetune.commands.check import training_process_environment
    from finetune.config import launch_request

    arguments = ["--config_file", str(config_file), *flags, SCRIPT]
    try:
        environment, _ = training_process_environment(arguments)  # as accelerate's own launcher code exports it
    except RuntimeError:  # accelerate's launcher stops on its own on a file it cannot run (FP8 without its packages)
        environment = {}
    for name, value in {**environment, "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_request, "accelerate_launch_arguments", lambda: arguments)
    values = yaml.safe_load(config_file.read_text())
    processes = 1 if values.get("distributed_type") in ("NO", "MULTI_CPU") else values.get("num_processes", 1)
    monkeypatch.setattr(accelerate_checks, "launched_processes", lambda: processes)


@pytest.mark.parametrize("launcher", ["finetune launch", "accelerate launch"])
@pytest.mark.parametrize("case", REFUSED_BEFORE_LAUNCH, ids=[case[0] for case in REFUSED_BEFORE_LAUNCH])
def test_a_file_asking_for_what_does_not_run_here_is_refused_under_both_launchers(case, launcher, tmp_path, capfd,
                                                                                 monkeypatch):
    name, config_file, words, flags = case
    if launcher == "finetune launch":
        check_bad_input((name, lambda t: TINY, words, finetune_launch_of(config_file, flags)), tmp_path, capfd,
                        monkeypatch)
    else:
        launched_by_accelerate(monkeypatch, config_file(tmp_path), flags)
        check_bad_input((name, lambda t: TINY, words), tmp_path, capfd, monkeypatch)


# Files `finetune launch` hands to accelerate unchanged, each compared with the recipe in the training process:
# (name, config file, folder launched from, words of the training process's refusal or None, its note or None).
ONE_STEP = ["--gradient_accumulation_steps", "1"]
CHECKED_IN_TRAINING = [
    ("TRL multi-GPU", TRL / "multi_gpu.yaml", ROOT, [], None, None),
    ("TRL FSDP2", TRL / "fsdp2.yaml", ROOT, [], None, None),
    ("TRL single GPU", TRL_EXAMPLES / "single_gpu.yaml", ROOT, [], None, None),
    ("TRL single GPU saying 8 processes", TRL / "single_gpu.yaml", ROOT, [], None,
     "`num_processes: 8` is ignored under `distributed_type: NO`: one process trains"),
    ("TRL ZeRO-2", TRL / "zero2.yaml", ROOT, [], None, None),
    ("TRL ZeRO-3", TRL / "zero3.yaml", ROOT, [], None, None),
    ("TRL ZeRO-1 accumulating 1 step", TRL / "zero1.yaml", ROOT, [],
     ["zero1.yaml", ("`gradient_accumulation_steps: 1` under deepspeed_config contradicts the recipe's "
                     "`gradient_accumulation_steps: 2`"), "remove it"], None),
    ("TRL ZeRO-1 with the recipe accumulating 1 step", TRL / "zero1.yaml", ROOT, ONE_STEP, None, None),
    ("alignment-handbook DDP", HANDBOOK / "ddp.yaml", ROOT, [], None, None),
    ("alignment-handbook ZeRO-3", HANDBOOK / "zero3.yaml", ROOT, [], None, None),
    ("alignment-handbook ZeRO-1", HANDBOOK / "deepspeed_zero1.yaml", ROOT, [], None, None),
    ("alignment-handbook ZeRO-2 accumulating 1 step", HANDBOOK / "deepspeed_zero2.yaml", ROOT, [],
     ["deepspeed_zero2.yaml", "`gradient_accumulation_steps: 1` under deepspeed_config"], None),
    ("accelerate multi-GPU", TEMPLATES / "multi_gpu.yaml", ROOT, [], None, None),
    ("accelerate single accelerator", TEMPLATES / "single_accelerator.yaml", ROOT, [], None, None),
    ("accelerate two machines", TEMPLATES / "multi_node.yaml", ROOT, [], None, None),
    # their DeepSpeed JSONs, relative to the folder they are launched from, meet check_deepspeed_agrees (below)
    ("accelerate DeepSpeed template", TEMPLATES / "deepspeed.yaml", TEMPLATES, [], None, None),
    ("accelerate ALST example (no parallelism_config)", ALST / "sp-alst.accelerate-config.yml", ALST, [], None, None),
]


@pytest.mark.parametrize("case", CHECKED_IN_TRAINING, ids=[case[0] for case in CHECKED_IN_TRAINING])
def test_a_file_runs_as_it_says_or_its_contradiction_with_the_recipe_is_refused(case, tmp_path, monkeypatch, capsys):
    from finetune.checks import launch as accelerate_checks
    from finetune.commands import launch as launcher
    from finetune.errors import UserError

    _, config_file, folder, flags, refusal, note = case
    monkeypatch.chdir(folder)
    monkeypatch.setattr(launcher, "default_config_file", lambda: str(tmp_path / "no-default.yaml"))
    command = launcher.accelerate_command(["--config_file", str(config_file), *TINY, *flags])
    assert command[command.index("--config_file") + 1] == str(config_file)
    assert command[command.index(str(launcher.SFT_SCRIPT)):] == [str(launcher.SFT_SCRIPT), *TINY, *flags]

    launched_by_accelerate(monkeypatch, config_file)
    run = arguments.parse_args([*TINY, *flags, "--output_dir", str(tmp_path / "out")])
    capsys.readouterr()
    if refusal:
        with pytest.raises(UserError) as refused:
            accelerate_checks.check_run(run)
        assert all(word in str(refused.value) for word in refusal), refused.value
        return
    accelerate_checks.check_run(run)
    printed = capsys.readouterr().out
    assert (note in printed) if note else "[finetune]" not in printed, printed


ZERO2_FILES = ("zero2.yaml", "zero2.json")  # accelerate_configs/zero2.yaml and the DeepSpeed JSON it names


def counting_reads(monkeypatch, names: tuple[str, ...]) -> tuple[dict, list]:
    """How many times each file named `names` is opened from now on, while the returned switch holds True (every read
    goes through io.open: `open`, Path.read_text, yaml and json loaders on open files), where from."""
    import builtins
    import io

    counts, counting, real_open = dict.fromkeys(names, 0), [True], io.open

    def counted_open(file, *args, **kwargs):
        name = Path(os.fspath(file)).name if isinstance(file, (str, os.PathLike)) else None
        if counting[0] and name in counts:
            counts[name] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counted_open)
    monkeypatch.setattr(builtins, "open", counted_open)
    return counts, counting


def test_a_training_process_reads_the_accelerate_config_and_its_deepspeed_json_once(tmp_path, monkeypatch):
    """The launch is read once (launch_request.read_exported_launch) and carried on the run: the parse and every check
    of a ZeRO-2 run, as accelerate's launcher starts its training process, read the launcher's arguments, the
    accelerate config and its DeepSpeed JSON once each, and the checks (checks/launch.py's check_run among them)
    none of them again."""
    from finetune.config import launch_request

    monkeypatch.chdir(ROOT)
    launched_by_accelerate(monkeypatch, ROOT / "accelerate_configs" / "zero2.yaml")
    argument_reads, read_arguments = [], launch_request.accelerate_launch_arguments
    monkeypatch.setattr(launch_request, "accelerate_launch_arguments",
                        lambda: argument_reads.append(1) or read_arguments())
    counts, _ = counting_reads(monkeypatch, ZERO2_FILES)
    run = arguments.parse_args([*TINY, "--output_dir", str(tmp_path / "out")])
    assert run.launch.strategy == "zero2" and run.launch.request.file.endswith("zero2.yaml")
    recipe_checks.check(run)
    assert counts == {"zero2.yaml": 1, "zero2.json": 1}
    assert len(argument_reads) == 1


def test_finetune_checks_training_side_reads_the_accelerate_config_and_its_deepspeed_json_once(tmp_path,
                                                                                               monkeypatch, capsys):
    """`finetune check --config_file accelerate_configs/zero2.yaml`: what stands for the training process (the parse
    and every check of the run) reads each launch file once; the launcher's side of the command reads them as
    `finetune launch` does."""
    from finetune import cli
    from finetune.commands import check

    monkeypatch.chdir(ROOT)
    counts, counting = counting_reads(monkeypatch, ZERO2_FILES)
    counting[0] = False
    checked = check.problems_before_loading

    def counted(*args):
        counting[0] = True
        try:
            return checked(*args)
        finally:
            counting[0] = False

    monkeypatch.setattr(check, "problems_before_loading", counted)
    code = cli.main(["check", "--config_file", "accelerate_configs/zero2.yaml", *TINY,
                     "--output_dir", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    assert counts == {"zero2.yaml": 1, "zero2.json": 1}


def float32_recipe(tmp: Path) -> list[str]:
    """The full fine-tuning recipe in float32."""
    return ["--config", str(write(tmp / "float32.yaml", FULL.read_text().replace("bf16: true", "bf16: false"))), "--tiny"]


# A user's edits of external files that contradict the recipe (full.yaml: bf16, no compilation, no checkpointing):
# (name, the file edited, the fields written over, the arguments (or a function of tmp_path building them), words).
CONTRADICTING_THE_RECIPE = [
    ("mixed precision fp16 against the recipe's bf16", TRL / "multi_gpu.yaml", {"mixed_precision": "fp16"}, [],
     ["multi_gpu.yaml", "`mixed_precision: fp16` contradicts the recipe's `bf16: true`", "set it to 'bf16'"]),
    ("mixed precision bf16 against the recipe's float32", TRL / "multi_gpu.yaml", {}, float32_recipe,
     ["`mixed_precision: bf16` contradicts the recipe's `bf16: false`", "set it to 'no'"]),
    ("a dynamo backend without torch_compile", TRL / "multi_gpu.yaml", {"dynamo_config": {"dynamo_backend": "INDUCTOR"}},
     [], ["multi_gpu.yaml", "`dynamo_backend: INDUCTOR` would compile the whole model", "set it to 'NO'",
          "`torch_compile`"]),
    ("FSDP's activation checkpointing and the recipe's", TRL_EXAMPLES / "context_parallel_2gpu.yaml", {},
     ["--gradient_checkpointing", "true"],
     ["`fsdp_activation_checkpointing: true` and the recipe's `gradient_checkpointing: true`", "set one of them"]),
]


@pytest.mark.parametrize("case", CONTRADICTING_THE_RECIPE, ids=[case[0] for case in CONTRADICTING_THE_RECIPE])
def test_an_accelerate_field_the_recipe_overrides_is_refused_naming_both(case, tmp_path, capfd, monkeypatch):
    name, source, fields, arguments, words = case
    edited = derived(tmp_path, source, lambda values: {**without_parallelism(values), **fields})
    launched_by_accelerate(monkeypatch, edited)
    build = arguments if callable(arguments) else lambda t: [*TINY, *arguments]
    check_bad_input((name, build, words), tmp_path, capfd, monkeypatch)


def test_mixed_precision_no_gives_way_to_the_recipe_and_says_so(tmp_path, monkeypatch, capsys):
    from finetune.checks import launch as accelerate_checks

    edited = derived(tmp_path, TRL / "multi_gpu.yaml", lambda values: {**values, "mixed_precision": "no"})
    launched_by_accelerate(monkeypatch, edited)
    run = arguments.parse_args([*TINY, "--output_dir", str(tmp_path / "out")])
    capsys.readouterr()
    accelerate_checks.check_run(run)
    assert "`mixed_precision: no` gives way to the recipe's `bf16: true`, which runs" in capsys.readouterr().out


def json_run(recipe_bf16: bool, compiled: bool = False):
    """What check_deepspeed_agrees reads of a run of recipes/llama-3.2-1b/full.yaml: on a GPU (bf16) or on this
    machine (float32), launched as the environment says."""
    training = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_grad_norm=1.0,
                               learning_rate=2e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                               weight_decay=0.0, bf16=recipe_bf16, fp16=False,
                               optim=SimpleNamespace(value="adamw_torch_fused"),
                               lr_scheduler_type=SimpleNamespace(value="cosine"), torch_compile=compiled)
    from finetune.config.launch_request import read_exported_launch

    return SimpleNamespace(training=training, recipe_path=str(ROOT / "recipes" / "llama-3.2-1b" / "full.yaml"),
                           recipe={"bf16": True}, launch=read_exported_launch())


ACCELERATE_TEMPLATE_WORDS = [
    "`gradient_accumulation_steps: 1` contradicts the recipe's `gradient_accumulation_steps: 2`",
    "`fp16.enabled: true` contradicts the recipe's `bf16: true`",
    "set them to \"auto\" so that the recipe decides"]
CPU_BF16 = "`bf16.enabled: true` asks for bf16, which this machine without a GPU does not train in (float32)"
COMPILE_IGNORED = "its `compile` block (inductor) is ignored by a run that is not compiled (`torch_compile: false`)"
# (JSON, words of the refusal on a GPU (the recipe in bf16) or None, on this machine or None)
DEEPSPEED_JSONS = [
    *[(DEEPSPEED_TEMPLATES / name, ACCELERATE_TEMPLATE_WORDS, ACCELERATE_TEMPLATE_WORDS)
      for name in ("zero_stage1_config.json", "zero_stage2_config.json", "zero_stage2_offload_config.json",
                   "zero_stage3_config.json", "zero_stage3_offload_config.json")],
    (ALST / "sp-alst.ds-config.json", ["`gradient_accumulation_steps: 1` contradicts", "set it to \"auto\""],
     ["`gradient_accumulation_steps: 1` contradicts", CPU_BF16, "set them to \"auto\""]),
    *[(AXOLOTL / name, None, None) for name in ("zero1.json", "zero2.json", "zero3.json")],
    *[(AXOLOTL / name, [COMPILE_IGNORED], [COMPILE_IGNORED])
      for name in ("zero1_torch_compile.json", "zero2_torch_compile.json")],
    *[(AXOLOTL / name, None, [CPU_BF16, "set it to \"auto\""])
      for name in ("zero3_bf16.json", "zero3_bf16_cpuoffload_all.json", "zero3_bf16_cpuoffload_params.json")],
]


@pytest.mark.parametrize("json_file, on_gpu, on_cpu", DEEPSPEED_JSONS, ids=[case[0].name for case in DEEPSPEED_JSONS])
def test_a_deepspeed_json_deciding_what_the_recipe_decides_is_refused_naming_both(json_file, on_gpu, on_cpu,
                                                                                  monkeypatch):
    """A JSON's own optimizer and scheduler would replace the recipe's without a word, its hard-coded fp16/bf16 and
    accumulation fail in transformers once the model is loaded: every contradiction in one sentence, before."""
    from finetune.checks import recipe as recipe_checks
    from finetune.errors import UserError

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(json_file))
    for words, bf16 in ((on_gpu, True), (on_cpu, False)):
        if words is None:
            recipe_checks.check_deepspeed_agrees(json_run(bf16))
            continue
        with pytest.raises(UserError) as refused:
            recipe_checks.check_deepspeed_agrees(json_run(bf16))
        sentence = str(refused.value)
        assert sentence.startswith(f"{json_file}: ") and sentence.count("; ") == 1, sentence
        assert all(word in sentence for word in words), sentence


def test_axolotls_compiling_deepspeed_jsons_run_with_a_compiled_recipe(monkeypatch):


    for name in ("zero1_torch_compile.json", "zero2_torch_compile.json"):
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(AXOLOTL / name))
        recipe_checks.check_deepspeed_agrees(json_run(True, compiled=True))


def test_accelerate_fields_beside_a_deepspeed_json_are_refused_before_accelerate_refuses_them(monkeypatch):
    """accelerate exports the file's DeepSpeed fields (ACCELERATE_CONFIG_DS_FIELDS) and raises over them while the
    training arguments are built; the training process reads them first, when it reads the JSON."""
    from finetune.config.launch_request import read_deepspeed_config
    from finetune.errors import UserError

    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "zero3_init_flag,gradient_accumulation_steps,mixed_precision")
    with pytest.raises(UserError, match="`gradient_accumulation_steps` and `mixed_precision` cannot be set beside "
                                        "`deepspeed_config_file: .*zero3_bf16.json`"):
        read_deepspeed_config(str(AXOLOTL / "zero3_bf16.json"))


def test_the_setup_line_names_what_is_offloaded_and_the_optimizer_inside_its_wrappers():
    import torch

    from finetune.run import trainer

    plugin = SimpleNamespace(deepspeed_config=json.loads((AXOLOTL / "zero3_bf16_cpuoffload_params.json").read_text()))
    assert trainer._offloaded(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))) == {"parameters": "cpu"}
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=False)
    zero_wrapped = SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer))  # accelerate's, then DeepSpeed's
    assert trainer._optimizer_name(trainer._innermost(zero_wrapped, "optimizer")) == "AdamW"


@pytest.mark.launches
def test_trls_single_gpu_file_trains_one_process_and_says_what_it_ignored(tmp_path):
    """The real launcher: the training process finds its launcher's file, says that `num_processes: 8` is ignored,
    and its setup line names the optimizer and the schedule that run (the recipe's)."""
    output_dir = tmp_path / "out"
    result = subprocess.run(
        [ACCELERATE, "launch", "-q", "--config_file", str(TRL / "single_gpu.yaml"), "--main_process_port",
         str(free_port()), SCRIPT, *TINY, "--dataset_name", str(ROOT / "data" / "sample"), "--max_steps", "2",
         "--eval_strategy", "no", "--report_to", "none", "--eval_samples_before_after", "0",
         "--output_dir", str(output_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy(), check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{TRL / 'single_gpu.yaml'}: `num_processes: 8` is ignored under `distributed_type: NO`: one process " \
           f"trains" in result.stdout
    setup = printed_setup(result.stdout)
    assert setup["world_size"] == 1 and setup["strategy"] == "single", setup
    assert (setup["optimizer"], setup["lr_schedule"], setup["offload"]) == ("AdamW (fused)", "cosine", {}), setup
    assert (output_dir / "model.safetensors").is_file()


@pytest.mark.launches
def test_finetune_launch_exits_143_for_a_run_a_sigterm_stopped_whatever_its_launcher_returned():
    """accelerate 1.15 exits 1 once its torchrun re-raises a SIGTERM, and 1.15-1.16 exit 1 when only the training
    processes got it; a training process stopped by SIGTERM writes so in its outcome (finetune/outcome.py), which
    decides."""
    import sys

    from finetune.commands import launch as launcher

    stopped = "from finetune import outcome; outcome.record(outcome.PREEMPTED, 'out'); raise SystemExit(1)"
    assert launcher.run_and_report([sys.executable, "-c", stopped]) == (143, None, None)
    assert launcher.run_and_report([sys.executable, "-c", "raise SystemExit(1)"]) == (1, None, None)


@pytest.mark.launches
@pytest.mark.parametrize(("config_file", "strategy"), [
    (TRL / "multi_gpu.yaml", "ddp"), (TRL / "fsdp2.yaml", "fsdp"), (TRL / "zero3.yaml", "zero3")],
    ids=["TRL multi_gpu", "TRL fsdp2", "TRL zero3"])
def test_a_file_for_several_gpus_trains_two_processes_as_it_says(config_file, strategy, tmp_path):
    """TRL's files for 8 GPUs, launched as they are on two CPU processes (`--num_processes 2` is the only change):
    what runs is the strategy the file names, and the run saves one ordinary model."""
    output_dir = tmp_path / "out"
    result = subprocess.run(
        [ACCELERATE, "launch", "-q", "--config_file", str(config_file), "--num_processes", "2",
         "--main_process_port", str(free_port()), SCRIPT, *TINY, "--max_steps", "2", "--eval_strategy", "no",
         "--report_to", "none", "--eval_samples_before_after", "0", "--output_dir", str(output_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=420, env=os.environ.copy(), check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    setup = printed_setup(result.stdout)
    assert (setup["world_size"], setup["strategy"]) == (2, strategy), setup
    assert (output_dir / "model.safetensors").is_file()


def test_the_final_save_under_fsdp2s_default_sharded_state_dict_writes_the_whole_model(tmp_path):
    """accelerate's FSDP2 files without `fsdp_state_dict_type` (its own tests/distributed/accelerate_configs/fsdp2.yaml)
    get SHARDED_STATE_DICT, under which transformers' save_model writes nothing: such a run trained to its end and then
    failed at the final save. The trainer here saves as transformers does, by that state dict type."""
    from accelerate.utils import FullyShardedDataParallelPlugin



    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type)

    def save_model(folder):  # transformers' Trainer.save_model under FSDP
        if "FULL_STATE_DICT" in str(plugin.state_dict_type):
            write(Path(folder) / "model.safetensors", "weights")

    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None,
                                  state=SimpleNamespace(fsdp_plugin=plugin))
    saving.save_final_completely(SimpleNamespace(accelerator=accelerator, save_model=save_model), tmp_path)
    assert (tmp_path / "model.safetensors").is_file()


def test_an_fsdp_file_wrapping_a_layer_class_the_model_lacks_is_refused_before_loading(tmp_path, monkeypatch):
    """accelerate's examples name BertLayer in `fsdp_transformer_layer_cls_to_wrap`; accelerate fails on a class the
    model does not have once the model is loaded."""

    from finetune.config.launch_request import read_exported_launch
    from finetune.errors import UserError

    run = arguments.parse_args([*TINY, "--output_dir", str(tmp_path / "out")])
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # as accelerate launch exports an FSDP file's fields
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer")
    run.launch = read_exported_launch()  # what an FSDP launch's processes read (parsed without FSDP's version check)
    model_folder.resolve_model_path(run)
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "BertLayer")
    with pytest.raises(UserError, match="`fsdp_transformer_layer_cls_to_wrap: BertLayer` names BertLayer, which "
                                        r"meta-llama/Llama-3.2-1B-Instruct does not have \(its decoder layers: "
                                        "LlamaDecoderLayer\\); remove the field"):
        model_folder.resolve_model_path(run)


DEEPSPEED_FILES_REFUSED = [
    # (the JSON's bytes, the words of the one sentence): each failed in accelerate or DeepSpeed, after loading
    (b'[{"zero_optimization": {"stage": 2}}]', "a DeepSpeed config is a JSON object of settings, not a list"),
    (b'{"zero_optimization": {"stage": 2}, "note": "\xff"}', "not UTF-8 text; save it as UTF-8"),
    (b'{"train_micro_batch_size_per_gpu": "auto"}', "no `zero_optimization` object, which accelerate requires"),
    (b'{"zero_optimization": {"stage": 2}}',  # accelerate reads no accumulation as 1, not "auto"
     "`gradient_accumulation_steps: 1` (left out: accelerate sets it) contradicts the recipe's "
     "`gradient_accumulation_steps: 2`"),
]


@pytest.mark.parametrize("content, words", DEEPSPEED_FILES_REFUSED, ids=[w[:30] for _, w in DEEPSPEED_FILES_REFUSED])
def test_a_deepspeed_json_accelerate_or_deepspeed_would_fail_on_is_refused_naming_it(content, words, tmp_path,
                                                                                     monkeypatch):
    from finetune.errors import UserError

    json_file = tmp_path / "ds.json"
    json_file.write_bytes(content)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(json_file))
    with pytest.raises(UserError) as refused:
        recipe_checks.check_deepspeed_agrees(json_run(True))
    assert str(refused.value).startswith(f"{json_file}: ") and words in str(refused.value), str(refused.value)


# The FSDP version 1 files of TRL, accelerate's templates and alignment-handbook: accelerate would run FSDP1's
# wrappers and state dicts, which this toolkit does not train with
FSDP_VERSION_1_FILES = [TRL / "fsdp1.yaml", TEMPLATES / "fsdp.yaml", HANDBOOK / "fsdp.yaml"]
FSDP_VERSION_1_WORDS = ["an FSDP version 1 file", "`fsdp_version: 2`", "accelerate_configs/fsdp.yaml"]


@pytest.mark.parametrize("launcher", ["finetune launch", "accelerate launch"])
@pytest.mark.parametrize("config_file", FSDP_VERSION_1_FILES, ids=lambda path: str(path.relative_to(CONFIGS)))
def test_an_fsdp_version_1_file_is_refused_in_one_line_under_both_launchers(config_file, launcher, tmp_path, capfd,
                                                                            monkeypatch):
    from finetune.commands.check import training_process_environment

    words = [config_file.name, *FSDP_VERSION_1_WORDS]
    if launcher == "finetune launch":
        check_bad_input(("FSDP1", lambda t: TINY, words, finetune_launch_of(lambda t: config_file, [])), tmp_path,
                        capfd, monkeypatch)
        return
    # what accelerate's own launcher code exports to each training process of this file (one process: the parse
    # would otherwise set up a process group), with its command line
    environment, _ = training_process_environment(["--config_file", str(config_file), SCRIPT])
    for name, value in {**environment, "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    launched_by_accelerate(monkeypatch, config_file)
    check_bad_input(("FSDP1", lambda t: TINY, words), tmp_path, capfd, monkeypatch)


def test_every_external_config_file_is_tried_by_a_test_of_this_module(monkeypatch, tmp_path):
    """The README counts the files of tests/data/external/configs as tested: each one is the file of a case above (a
    case that edits a copy counts its source), so a file added there without a case fails here."""
    monkeypatch.setattr(sys.modules[__name__], "derived", lambda tmp, source, change: source)
    tried = {config_file(tmp_path) for _, config_file, _, _ in REFUSED_BEFORE_LAUNCH}
    tried |= {case[1] for case in CHECKED_IN_TRAINING} | {case[1] for case in CONTRADICTING_THE_RECIPE}
    tried |= {case[0] for case in DEEPSPEED_JSONS} | set(FSDP_VERSION_1_FILES)
    from tests.test_deepspeed_flag import REFUSED_EXAMPLES, SHIPPED_JSONS  # as --deepspeed

    tried |= {case[0] for case in SHIPPED_JSONS} | {case[0] for case in REFUSED_EXAMPLES}
    shipped = {path for path in CONFIGS.rglob("*") if path.is_file() and path.name != "README.md"}
    assert not shipped - tried, f"external files no case tries: {sorted(str(p.relative_to(CONFIGS)) for p in shipped - tried)}"
    readme = (ROOT / "README.md").read_text()
    assert f"{len(shipped)} such files are tested from `tests/data/external/configs/`" in readme
