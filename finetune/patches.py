"""Every change this toolkit makes to another library's private behaviour, in one place.

Each is a small function called from one visible spot; none runs at import. When a library fixes the problem or
renames what is patched, this list says what to revisit and which test fails first.

- `FinetuneTrainer._save_checkpoint` (finetune/train.py, the one override of a private Trainer method)
  does: runs the Trainer's save, then flushes it and writes the completeness marker; save errors become one sentence.
  why: a kill mid-save leaves a folder that looks like a complete checkpoint.
  targets: transformers 5.17-5.24 `Trainer._save_checkpoint(model, trial)`.
  guarded by: tests/test_preemption_single.py, tests/test_preemption_ddp.py, tests/test_preemption_zero3.py.
- `rotation_deferred`
  does: makes `transformers.trainer.rotate_checkpoints` a no-op during one save; `checkpoints.rotate` runs after.
  why: the Trainer rotates before our marker exists and could delete the only complete checkpoint.
  targets: transformers 5.17-5.24 (module-level `rotate_checkpoints`).
  guarded by: test_preemption_single.py::test_save_total_limit_one_never_leaves_no_complete_checkpoint.
- `compile_inside_checkpoints`
  does: sets each layer's `_gradient_checkpointing_func` so that it runs checkpoint(compiled(layer)); with activation
  offloading, the layer's recomputation in backward runs under identity saved-tensor hooks.
  why: compiled around a checkpoint, one graph break makes dynamo run the whole layer eagerly. The checkpoint is
  reentrant, and TRL's offloading hooks stay active through the backward: without hooks of its own, every tensor the
  recomputed layer saves would be copied to the CPU and straight back.
  upstream: pytorch/pytorch#139989.
  targets: `GradientCheckpointingLayer` of transformers 5.17 (checkpoint in `__call__`) and 5.24 (in `forward`);
  trl 1.16 `OffloadActivations` (saved-tensor hooks around `training_step`, forward and backward).
  guarded by: test_train.py::test_under_checkpointing_a_layer_with_a_graph_break_is_still_compiled_once_for_all_layers
  and test_train.py::test_offloading_compiled_checkpoints_moves_only_layer_inputs_and_keeps_the_gradients.
- `exit_without_teardown`
  does: runs the atexit handlers, flushes, then `os._exit(0)` at the end of a multi-process run.
  why: gloo's worker threads aborted a finished rank at interpreter teardown in about 1 of 100 CPU launches.
  upstream: pytorch/pytorch#190489.  targets: torch 2.11-2.13.
  guarded by: tests/test_distributed.py (every two-process launch must exit 0).
- `switch_cpu_state_to_fsdp`
  does: sets accelerate's shared state (`PartialState._shared_state`) to FSDP over gloo.
  why: accelerate switches to FSDP only from a GPU state; on CPU it would wrap the model in DDP.
  targets: accelerate 1.15-1.16.
  guarded by: test_distributed.py::test_full_finetune_runs_the_strategy_of_its_config_file[fsdp] and
  ::test_fsdp_config_falling_back_to_ddp_stops_with_a_clear_error.
- `expert_lora.install` (finetune/expert_lora.py)
  does: swaps the class of peft's outermost `ParamWrapper` around each GPT-OSS experts module for a subclass whose
  forward runs the experts through grouped GEMMs with the LoRA factors, reading peft's `lora_A`/`lora_B` layout and
  private `_did_swap_in_out_features` as `ParamWrapper.get_delta_weight` does.
  why: peft's forward parametrizes every expert weight as W + B·A and lets autograd compute its full gradient.
  targets: peft 0.21.0-0.21.2 (`ParamWrapper`), transformers 5.17-5.24 (`GptOssExperts`, `is_transposed`).
  guarded by: tests/test_expert_lora.py (against peft's path), test_distributed.py::test_lora_saves_the_single_process_adapter.
- `zero3_init_off`
  does: unsets transformers' ZeRO-3 flag (`_hf_deepspeed_config_weak_ref`) while the tiny model is built and written.
  why: under a ZeRO-3 launch `from_config` builds empty partitions, which would be saved as the tiny model.
  targets: transformers 5.17-5.24.
  guarded by: test_distributed.py::test_full_finetune_gives_the_single_process_answer[zero3].
"""

import atexit
import contextlib
import os
import sys
from functools import partial


@contextlib.contextmanager
def rotation_deferred():
    """The Trainer rotates checkpoints inside its save, before our marker exists; skip that, `checkpoints.rotate`
    runs once the marker is written."""
    import transformers.trainer as trainer_module

    original = trainer_module.rotate_checkpoints
    trainer_module.rotate_checkpoints = lambda *args, **kwargs: None
    try:
        yield
    finally:
        trainer_module.rotate_checkpoints = original


def _checkpoint_compiled(checkpoint, compiled_call, function, *args):
    # Reentrant: the backward reruns the layer and differentiates that rerun. Non-reentrant checkpointing instead
    # requires the rerun to save tensors shaped like the forward's, which two compiled graphs need not do (GPT-OSS
    # with expert LoRA on an H200: CheckpointError "Recomputed values ... have different metadata").
    return checkpoint(compiled_call, function, *args, use_reentrant=True)


def _same_tensor(tensor):
    return tensor


def _call_keeping_saved_tensors(compiled_call, function, *args):
    """The innermost saved-tensor hooks win: these keep what the call saves where it is, out of the offloading hooks.
    Only the recomputation saves anything (the checkpointed forward runs without gradients)."""
    import torch

    with torch.autograd.graph.saved_tensors_hooks(_same_tensor, _same_tensor):
        return compiled_call(function, *args)


def compile_inside_checkpoints(model, compiled_call, offloading: bool = False) -> None:
    """Every checkpointed layer runs checkpoint(compiled(layer)) instead of compiled(checkpoint(layer)); one compiled
    function serves all layers, so the layer compiles once. With activation offloading only the checkpoint's inputs
    go to the CPU: the layer recomputed in backward keeps its tensors on the device until its gradients are done."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    call = partial(_call_keeping_saved_tensors, compiled_call) if offloading else compiled_call
    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(module, GradientCheckpointingLayer) and getattr(checkpoint, "func", None) is not _checkpoint_compiled:
            module._gradient_checkpointing_func = partial(_checkpoint_compiled, checkpoint, call)


def exit_without_teardown() -> None:
    """What a normal exit runs first (logging, trackers: wandb finishes its run here), then exit 0 without the
    interpreter's finalization, during which gloo's worker threads can abort a finished rank."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def switch_cpu_state_to_fsdp() -> None:
    """accelerate's state as FSDP over gloo, with the plugin built from the launch's FSDP_* variables; the Trainer's
    Accelerator reuses it."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

    plugin = FullyShardedDataParallelPlugin()
    state = AcceleratorState(cpu=True, dynamo_plugin=TorchDynamoPlugin(), fsdp_plugin=plugin, _from_accelerator=True)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


@contextlib.contextmanager
def zero3_init_off():
    """`from_config` inside a ZeRO-3 launch builds the model under deepspeed.zero.Init (placeholders for the rank's
    partition); with transformers' ZeRO-3 flag unset it builds whole parameters."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
