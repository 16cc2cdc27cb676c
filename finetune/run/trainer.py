"""Training: TRL's SFTTrainer, plus what it lacks: a check that what runs is what the accelerate config asked for,
resume from the output folder, a generation config that stops, a record of the run, and a loss-curve PNG.
"""

import json
from pathlib import Path

import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, TrainerCallback
from trl import SFTTrainer

from finetune import json_files, outcome, patches, run_folder
from finetune.checks import launch as launch_checks
from finetune.checks import model_folder, resume
from finetune.checks.relaunch import run_identity, training_length
from finetune.compile_cache import inductor_cache
from finetune.config.launch_request import ExportedLaunch
from finetune.errors import UserError, say
from finetune.models import compilation, expert_lora, fp8, mxfp4_experts
from finetune.run import evaluation, out_of_memory, saving, speed, tracking
from finetune.run import generation as inference
from finetune.run import model as model_loading
from finetune.run.arguments import RunConfig
from finetune.run_folder import RUN_RECORD

LOSS_PLOT = "loss.png"


DATA_RECORD = "finetune_data.json"  # how many rows came from each dataset, beside the run record


class SetupMismatch(UserError):
    """The strategy or the activation checkpointing in place differs from what the accelerate config file asked for."""


def describe_setup(trainer: SFTTrainer) -> dict:
    """What actually runs: world size, distributed type, the wrapper around the model, the batch sizes, the precision,
    the optimizer and learning-rate schedule in place (DeepSpeed's own under offload), what is offloaded, and how the
    layers are checkpointed (patches.activation_checkpointing_found)."""
    accelerator = trainer.accelerator
    wrapped = trainer.model_wrapped
    setup = {
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "wrapper": type(wrapped).__name__,
        "per_device_batch": trainer.args.per_device_train_batch_size,
        "global_batch": trainer.args.per_device_train_batch_size
        * trainer.args.gradient_accumulation_steps
        * accelerator.num_processes,
        "precision": str(accelerator.mixed_precision),
        "optimizer": _optimizer_name(_innermost(trainer.optimizer, "optimizer")),
        "lr_schedule": _schedule_name(_innermost(trainer.lr_scheduler, "scheduler"), trainer.args),
        "offload": _offloaded(accelerator),
        "activation_checkpointing": patches.activation_checkpointing_found(wrapped),
    }
    if hasattr(wrapped, "zero_optimization_stage"):
        setup["zero_stage"] = wrapped.zero_optimization_stage()
    setup["dtensor_parameters"] = any(isinstance(parameter, DTensor) for parameter in trainer.model.parameters())
    setup["strategy"] = _strategy_of(setup)
    return setup


def _innermost(wrapped, attribute: str):
    """What accelerate's and DeepSpeed's wrappers hold, through every layer of them (optimizer, ZeRO optimizer, ...)."""
    while getattr(wrapped, attribute, None) is not None:
        wrapped = getattr(wrapped, attribute)
    return wrapped


def _optimizer_name(optimizer) -> str:
    fused = getattr(optimizer, "defaults", {}).get("fused")
    return type(optimizer).__name__ + (" (fused)" if fused else "")


def _schedule_name(scheduler, args) -> str:
    """The recipe's lr_scheduler_type when transformers built the schedule from it (a LambdaLR), else its class."""
    from torch.optim.lr_scheduler import LambdaLR

    if isinstance(scheduler, LambdaLR):
        return str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    return type(scheduler).__name__


def _offloaded(accelerator) -> dict:
    """What lives in CPU memory instead of the GPU's: ZeRO's optimizer states and parameters, or FSDP2's CPU offload
    (parameters, gradients and the optimizer step)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
    if deepspeed is not None:
        zero = deepspeed.deepspeed_config.get("zero_optimization", {})
        devices = {part: (zero.get(f"offload_{key}") or {}).get("device", "none")
                   for part, key in (("optimizer", "optimizer"), ("parameters", "param"))}
        return {part: device for part, device in devices.items() if device != "none"}
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy):
        return {"optimizer": "cpu", "parameters": "cpu"}
    return {}


def _strategy_of(setup: dict) -> str:
    if "zero_stage" in setup:
        return f"zero{setup['zero_stage']}"
    if setup["dtensor_parameters"]:
        return "fsdp"
    if setup["wrapper"] == "DistributedDataParallel":
        return "ddp"
    return "single" if setup["world_size"] == 1 else "unwrapped"


def setup_problem(setup: dict, requested: str, launched_world_size: int) -> str | None:
    """Why the running setup is not the one asked for, or None when it is."""
    if setup["world_size"] != launched_world_size:
        return (
            f"{launched_world_size} processes were launched but they train as {setup['world_size']} "
            f"independent run(s) of world size {setup['world_size']}"
        )
    if setup["strategy"] != requested:
        return f"the accelerate config asked for {requested} but {setup['strategy']} is running ({setup['wrapper']})"
    return None


def checkpointing_problem(setup: dict, launch: ExportedLaunch) -> str | None:
    """Why the accelerate config's activation checkpointing is not in place, or None when it is (or was not asked)."""
    if not launch.fsdp_activation_checkpointing or setup["activation_checkpointing"] == "fsdp":
        return None
    return (f"`fsdp_activation_checkpointing: true` checkpointed no layer of the model (activation checkpointing found: "
            f"{setup['activation_checkpointing']}); make `fsdp_auto_wrap_policy` wrap the decoder layers "
            f"(TRANSFORMER_BASED_WRAP, as accelerate_configs/fsdp.yaml does), or set it to false and checkpoint with "
            f"the recipe's `gradient_checkpointing: true`")


class SetupCheck(TrainerCallback):
    """Logs the setup once the model is wrapped, and stops the run before step 1 if it is not what was asked for."""

    def __init__(self, trainer: SFTTrainer, launch: ExportedLaunch):
        self.trainer = trainer
        self.launch = launch
        self.setup: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.setup = describe_setup(self.trainer)
        self.setup["strategy_from"] = self.launch.asked_by or "nothing asked for one"
        if self.trainer.accelerator.is_main_process:
            say(f"setup: {json.dumps(self.setup)}")
        problem = setup_problem(self.setup, self.launch.strategy, self.launch.world_size)
        if problem:
            raise SetupMismatch(
                f"{self.launch.asked_by or self.launch.config_file}: {problem}; fix distributed_type/num_processes in that "
                f"file or launch with the "
                f"config that matches what you want."
            )
        problem = checkpointing_problem(self.setup, self.launch)
        if problem:
            raise SetupMismatch(f"{self.launch.config_file}: {problem}.")


class WarmupNotice(TrainerCallback):
    """A warmup as long as the run: the Trainer's warmup trains its first step at rate 0 and never reaches the peak
    (a one-step run then saves an untrained model), which is said before the first step."""

    def on_train_begin(self, args, state, control, **kwargs):
        warmup = args.get_warmup_steps(state.max_steps)
        if state.global_step == 0 and warmup >= state.max_steps > 0:
            outcome = "trains nothing" if state.max_steps == 1 else "never reaches the learning rate"
            say(f"warmup_steps {args.warmup_steps} is a warmup of {warmup} steps, covering all {state.max_steps} steps "
                f"of this run: its first step trains at learning rate 0 and it {outcome}; lower warmup_steps or "
                f"train more steps.")


class FinetuneTrainer(SFTTrainer):
    """TRL's SFTTrainer with preemption-safe checkpoints: complete-or-skipped saves and SIGTERM as a save
    (finetune/run/saving.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_save_seconds = 0.0
        self.preemption = saving.Preemption(self)
        self.add_callback(self.preemption)

    def _save_checkpoint(self, model, trial=None):
        saving.save_checkpoint_completely(self, super()._save_checkpoint, model, trial)


def build_trainer(run: RunConfig, model: PreTrainedModel, tokenizer, train_set, eval_set) -> SFTTrainer:
    model_loading.fix_generation_config(model, tokenizer)
    in_float8 = fp8.convert_linear_layers(model) if run.finetune.fp8 else []  # before accelerate wraps or compiles it
    compiled = run.training.torch_compile
    trainer = FinetuneTrainer(
        model=model,
        args=run.training,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        peft_config=model_loading.lora_config(run),
        callbacks=compilation.compile_per_layer(run.training),
    )
    compilation.one_graph_for_every_layer(trainer.model, compiled)
    patches.keep_packed_documents_apart(trainer.model)
    expert_lora.use_kernel(trainer, run.finetune.expert_lora_kernel)
    if in_float8 and trainer.accelerator.is_main_process:
        say(f"fp8: {len(in_float8)} linear layers train in float8 ({fp8.SCALING} scaling); the LM head, "
              f"embeddings and norms in {str(model.dtype).removeprefix('torch.')}")
    trainer.add_callback(resume.ResumedRun(run.finetune.resume_with_new_schedule, run.training.learning_rate,
                                           resume.schedule_start(run.resumes_from)))
    trainer.add_callback(WarmupNotice())
    trainer.add_callback(speed.SpeedRecord(run.training.output_dir, trainer.accelerator.is_main_process, compiled))
    if compiled:
        trainer.add_callback(compilation.CompileNotice(model, "LoRA" if run.model.use_peft else "full",
                                                       run.training.gradient_checkpointing,
                                                       trainer.accelerator.is_main_process))
    setup_check = SetupCheck(trainer, run.launch)
    trainer.add_callback(setup_check)
    if tracking.wanted(run.training):
        trainer.add_callback(tracking.MlflowRecord(run, setup_check))
    scores = evaluation.before_after_callback(eval_set, run.finetune.eval_samples_before_after, tokenizer,
                                                run.training.max_length)
    if scores is not None:
        trainer.add_callback(scores)
    return trainer


def train_and_save(trainer: SFTTrainer, run: RunConfig, tokenizer) -> None:
    output_dir = run.training.output_dir
    resume_from = run_folder.resume_point(run.training.resume_from_checkpoint, output_dir)  # prints its choice
    is_main = trainer.accelerator.is_main_process
    if is_main:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / run_folder.FINAL_MARKER).unlink(missing_ok=True)  # training again: not finished now
        record = {**run_identity(run), "settings": resume.settings(run)}
        json_files.write_atomically(Path(output_dir) / RUN_RECORD, json.dumps(record, indent=2) + "\n")
        if run.data_sources:
            json_files.write_atomically(Path(output_dir) / DATA_RECORD, json.dumps(run.data_sources, indent=2) + "\n")
    before = None
    if run.finetune.sample_prompt and trainer.accelerator.num_processes == 1:
        before = inference.answer(trainer.model, tokenizer, run.finetune.sample_prompt,
                                      chat_template_kwargs=run.finetune.chat_template_kwargs)
    with saving.writes_reported(output_dir):
        try:
            with resume.read_safely(resume_from):
                try:
                    trainer.train(resume_from_checkpoint=resume_from)
                finally:  # MXFP4 experts' weights dequantized ahead or kept: not for the saving and sampling after
                    mxfp4_experts.PREFETCH.release()
        except resume.NothingLeftToTrain:
            say(f"{resume_from} is at max_steps: nothing left to train; writing the final model from it.")
        except torch.OutOfMemoryError:
            raise out_of_memory.as_user_error(run, trainer.state.global_step + 1) from None
        except BackendCompilerFailed as failed:  # the compiler writes its code into the compile cache folder
            reason = saving.io_failure_reason(failed.inner_exception)
            if reason is None:
                raise
            raise UserError(f"{inductor_cache()}: compiling could not write into the compile cache folder ({reason}); "
                            f"free space there, move the caches with --compile_cache_dir, or "
                            f"run eager with --torch_compile false.") from None
    saving.exit_if_preempted(trainer)  # SIGTERM: the checkpoint is saved; exit 143 without the final save
    saving.save_final_completely(trainer, output_dir)
    with saving.writes_reported(output_dir):
        write_beside_the_model(trainer, run, tokenizer, before)


def write_beside_the_model(trainer: SFTTrainer, run: RunConfig, tokenizer, before: str | None) -> None:
    """The loss history, the plot, the sample answer and, last, the marker that says the run is finished."""
    output_dir = run.training.output_dir
    trainer.save_state()  # trainer_state.json: the full-precision loss history beside the model
    if trainer.accelerator.is_main_process:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        if losses:
            say(f"train loss: {' -> '.join(f'{loss:.3f}' for loss in losses)}")
        save_loss_plot(trainer.state.log_history, Path(output_dir) / LOSS_PLOT)
        tracking.log_outputs(run.training, [Path(output_dir) / name for name in (LOSS_PLOT, RUN_RECORD, DATA_RECORD)])
        if before is not None:
            after = inference.answer(trainer.model, tokenizer, run.finetune.sample_prompt,
                                        chat_template_kwargs=run.finetune.chat_template_kwargs)
            say(f"{run.finetune.sample_prompt!r}\n  before training: {before!r}\n  after training:  {after!r}")
        outcome.record(outcome.SAVED, output_dir=output_dir)
        partitioned = model_folder.partitioned_checkpoint(Path(output_dir))
        if partitioned is None:
            run_folder.write_final_marker(output_dir, trainer.state.global_step, training_length(run.training))
            say(f"saved to {output_dir}")
        else:  # no final marker: the relaunch with the gather on resumes, and writes the model from its checkpoint
            say(partitioned_save_sentence(run, Path(output_dir) / partitioned, trainer.state.global_step))


def partitioned_save_sentence(run: RunConfig, saved: Path, step: int) -> str:
    """What a ZeRO-3 run saved without the 16-bit gather, and the relaunch that writes the model instead."""
    setting, fix = launch_checks.gather_left_off(run.launch)
    newest = run_folder.newest_complete(saved.parent)
    if newest is not None and run_folder.step_of(newest) == step:
        relaunch = f"it writes model.safetensors from {newest.name} without training"
    else:
        relaunch = f"it trains from {newest.name if newest else 'the start'} and writes model.safetensors"
    return (f"saved DeepSpeed's partitioned ZeRO-3 checkpoint {saved}, not a model ({setting}), and chat, generate, "
            f"eval and merge cannot load it; {fix} and relaunch: {relaunch}.")


def finish_run(trainer: SFTTrainer) -> None:
    """Every rank waits for the main one's writes and accelerate closes the process group; a process of a
    multi-process run then exits without the interpreter's teardown. gloo's worker threads outlive
    destroy_process_group, and their destruction during finalization aborted a finished rank about once in a hundred
    CPU launches ("terminate called without an active exception", pytorch/pytorch#190489; finetune/patches.py)."""
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    processes = accelerator.num_processes
    accelerator.end_training()
    if processes > 1:
        patches.exit_without_teardown()


def save_loss_plot(log_history: list[dict], path: Path) -> None:
    # A Figure of its own, not pyplot: choosing a backend here would turn off a notebook's inline plots for good
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for key, label in (("loss", "train"), ("eval_loss", "eval")):
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry]
        if points:
            axes.plot(*zip(*points), marker="o" if key == "eval_loss" else None, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    if axes.lines:  # a run shorter than logging_steps logged no loss
        axes.legend()
    figure.tight_layout()
    figure.savefig(path)
