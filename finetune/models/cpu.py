"""Everything that changes when there is no GPU, in one place, so that the shipped recipes and accelerate configs
run unchanged on a CPU machine (CI, laptops) and none of this touches the GPU path.

On CPU the run trains in float32 with the GPU-only kernels swapped for portable ones, and a multi-process launch is
turned into a gloo process group (accelerate would otherwise start N independent single-process runs).
"""

import os

import torch

from finetune.config.launch_request import fsdp_asked_for
from finetune.errors import say

# Kernels that exist only on CUDA, and the portable implementation that computes the same thing.
CPU_ATTENTION = {"flex_attention": "eager", "flash_attention_2": "sdpa", "flash_attention_3": "sdpa",
                 "kernels-community/vllm-flash-attn3": "eager"}


CPU_EXPERTS = {"grouped_mm": "eager", "batched_mm": "eager"}


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def cpu_overrides(values: dict) -> dict:
    """The recipe values to replace on CPU: float32 training, no GPU-only kernels."""
    # torch_compile off too: inductor's C++ build takes minutes on a small CPU and tiny models gain nothing from it.
    # activation_offloading moves activations from GPU memory to the CPU's: without a GPU there is nothing to move
    # (TRL's implementation needs an accelerator and its streams).
    overrides = {"use_cpu": True, "bf16": False, "fp16": False, "dtype": "float32", "use_liger_kernel": False,
                 "torch_compile": False, "activation_offloading": False}
    if values.get("attn_implementation") in CPU_ATTENTION:
        overrides["attn_implementation"] = CPU_ATTENTION[values["attn_implementation"]]
    if values.get("experts_implementation") in CPU_EXPERTS:
        overrides["experts_implementation"] = CPU_EXPERTS[values["experts_implementation"]]
    if values.get("optim") in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_torch_8bit",
                               "adamw_torch_4bit"):  # bitsandbytes' and torchao's GPU memory savers
        overrides["optim"] = "adamw_torch"
    if values.get("tf32"):  # an Ampere-or-later GPU's matmul precision: transformers refuses it without one
        overrides["tf32"] = False
    changed = {key: value for key, value in overrides.items() if key in values and values[key] != value}
    if changed:
        say(f"No GPU: running on CPU with {changed} instead of the recipe's values.")
    return overrides


# What accelerate must read on CPU, where mixed precision is float32. The training arguments read it when they are
# built (as their `mixed_precision`) and the Trainer's Accelerator reads it again. DS_ACCELERATOR is DeepSpeed's own
# switch: accelerate imports DeepSpeed in every run (to unwrap models), and DeepSpeed, left to find an accelerator on a
# machine without a GPU, warns "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
# detect it." There is none to detect; told, it picks the same CPU accelerator silently.
CPU_ENVIRONMENT = {"ACCELERATE_MIXED_PRECISION": "no", "DS_ACCELERATOR": "cpu"}


def prepare_cpu_process_group() -> None:
    """Make a launch of N processes on a machine without a GPU one distributed run over gloo, in float32.

    The training arguments (`use_cpu`) have already created accelerate's state as a gloo process group; an FSDP
    launch then needs that state switched to FSDP before the Trainer builds its Accelerator from it: accelerate 1.15
    switches to FSDP only from a GPU-type state and on CPU (MULTI_CPU) would wrap the model in DDP. DeepSpeed's
    collectives go through gloo as well, instead of the shared-memory op it would compile on its first CPU run.
    """
    from finetune import patches

    os.environ.update(CPU_ENVIRONMENT)
    patches.deepspeed_collectives_without_compiled_op()
    if fsdp_shim_enabled():
        patches.switch_cpu_state_to_fsdp()


# Set to 0 to leave an FSDP launch on CPU to accelerate alone (it then runs as DDP, which the setup check refuses).
FSDP_SHIM_ENV = "FINETUNE_CPU_FSDP"


def fsdp_shim_enabled() -> bool:
    return fsdp_asked_for() and int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get(FSDP_SHIM_ENV, "1") != "0"


def deepspeed_on_the_process_group() -> None:
    """DeepSpeed's communication set up on the gloo group the training arguments made, before the model loads: accelerate
    does it only on GPUs, and ZeRO-3's loading (zero.Init) would otherwise see one process of the launch's N and refuse
    the batch transformers filled in for N. A process that no launcher started is a group of one."""
    import torch.distributed
    from deepspeed import comm

    if comm.is_initialized():
        return
    if torch.distributed.is_initialized():
        comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        return
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                          world_size=1)
