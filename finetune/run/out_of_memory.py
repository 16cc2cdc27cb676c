"""Running out of GPU memory, said as one sentence: at which step, how much memory, and the change that makes this
recipe fit this GPU, instead of torch's traceback of the allocator's state."""

import torch

from finetune.errors import UserError

GIB = 2**30


def gpu_memory_gib() -> tuple[float, float]:
    """The most memory this process's tensors held on its GPU, and the GPU's size."""
    device = torch.cuda.current_device()
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.get_device_properties(device).total_memory / GIB


def smaller_setting(training) -> str:
    """The first change that lowers the peak without changing what is learned: checkpointing, then half the
    micro-batch with twice the accumulation (the same global batch), then shorter rows."""
    if not training.gradient_checkpointing:
        return "add --gradient_checkpointing true"
    batch, accumulation = training.per_device_train_batch_size, training.gradient_accumulation_steps
    if batch > 1:
        return (f"halve the micro-batch with --per_device_train_batch_size {batch // 2} --gradient_accumulation_steps "
                f"{accumulation * 2} (the same global batch)")
    return f"lower --max_length below {training.max_length}"


def as_user_error(run, step: int) -> UserError:
    peak, total = gpu_memory_gib()
    where = run.recipe_path or "command line"
    planner = (f", or see what fits this GPU with `finetune plan --config {run.recipe_path} --gpu-memory {total:.0f}`"
               if run.recipe_path else "")
    return UserError(f"{where}: the run ran out of GPU memory in step {step} ({peak:.1f} GiB held by its tensors at "
                     f"the peak, of the GPU's {total:.1f} GiB); {smaller_setting(run.training)}{planner}.")
