"""Every change this toolkit makes to another library's private behaviour, in one place.

Each is a small function called from one visible spot; none runs at import. When a library fixes the problem or
renames what is patched, this table says what to revisit and which test fails first.

| patch | what it does | why | upstream | versions it targets | guarded by |
|---|---|---|---|---|---|
| `FinetuneTrainer._save_checkpoint` (finetune/train.py) | wraps the Trainer's save: marker written last, save errors as one sentence | a kill mid-save leaves a folder that looks complete | - | transformers 5.17-5.24 `Trainer._save_checkpoint(model, trial)` | tests/test_preemption_single.py (all), `_ddp.py`, `_zero3.py` |
| `rotation_deferred` | no-op `transformers.trainer.rotate_checkpoints` during one save | the Trainer rotates before our marker exists and can delete the only complete checkpoint | - | transformers 5.17-5.24 (module-level `rotate_checkpoints`) | test_preemption_single.py::test_save_total_limit_one_never_leaves_no_complete_checkpoint |
| `compile_inside_checkpoints` | sets each layer's `_gradient_checkpointing_func` to checkpoint(compiled(layer)) | compiled around a checkpoint, one graph break runs the whole layer eagerly | pytorch/pytorch#139989 | transformers 5.17 (`__call__`) and 5.24 (`forward`) `GradientCheckpointingLayer` | test_train.py::test_under_checkpointing_a_layer_with_a_graph_break_is_still_compiled_once_for_all_layers |
| `exit_without_teardown` | runs atexit handlers, flushes, then `os._exit(0)` after a multi-process run | gloo's threads aborted a finished rank in ~1% of CPU launches at interpreter teardown | pytorch/pytorch#190489 | torch 2.11-2.13 | tests/test_distributed.py (every 2-process launch exits 0) |
| `switch_cpu_state_to_fsdp` | sets accelerate's shared state to FSDP over gloo | accelerate switches to FSDP only from a GPU state; on CPU it wraps in DDP | - | accelerate 1.15-1.16 | test_distributed.py::test_full_finetune_runs_the_strategy_of_its_config_file[fsdp], ::test_fsdp_config_falling_back_to_ddp_stops_with_a_clear_error |
| `zero3_init_off` | unsets transformers' ZeRO-3 flag while the tiny model is written | under a ZeRO-3 launch `from_config` builds empty partitions, which would be saved as the tiny model | - | transformers 5.17-5.24 `_hf_deepspeed_config_weak_ref` | test_distributed.py::test_full_finetune_gives_the_single_process_answer[zero3] |
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


def compile_inside_checkpoints(model, compiled_call) -> None:
    """Every checkpointed layer runs checkpoint(compiled(layer)) instead of compiled(checkpoint(layer)); one compiled
    function serves all layers, so the layer compiles once."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(module, GradientCheckpointingLayer) and getattr(checkpoint, "func", None) is not _checkpoint_compiled:
            module._gradient_checkpointing_func = partial(_checkpoint_compiled, checkpoint, compiled_call)


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
