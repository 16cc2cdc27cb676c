"""Run under `accelerate launch`: train one step as scripts/sft.py does, then print what this rank really holds.

    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 tests/sharding_probe.py \
        --config recipes/llama-3.2-1b/full.yaml --tiny --max_steps 1 --save_strategy no --eval_strategy no \
        --output_dir /tmp/probe

Each rank writes `OUTPUT_DIR/sharding-probe-rank{R}.json` (a file per rank: two ranks printing to one pipe can
interleave their lines) with element counts and bytes of
  - the parameters it holds: FSDP2 the DTensors' local shards (`to_local()`); ZeRO-3 each parameter's partition
    (`ds_tensor`) and, separately, the full copies it keeps of "persistent" small parameters; ZeRO-2 (and anything
    else) the full parameters;
  - the optimizer state it holds: FSDP2 the torch optimizer's `state` tensors (Adam moments, and `step` apart);
    DeepSpeed the fp32 master partition (ZeRO-2 `single_partition_of_fp32_groups`, ZeRO-3
    `fp32_partitioned_groups_flat`) and the inner torch optimizer's state over it.
It also records the model folder, so that the test can count parameters from the same config.json.
"""

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from finetune.checks import model_folder
from finetune.errors import exit_on_user_error
from finetune.sft import prepare  # the same parse, check and load as a real run


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """Adam moments (everything but `step`) and the `step` tensors of a torch optimizer's state."""
    moments = moment_elems = step_bytes = 0
    dtypes = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            if key == "step":
                step_bytes += tensor_bytes(local)
                continue
            moments += tensor_bytes(local)
            moment_elems += local.numel()
            dtypes.add(str(local.dtype))
    return {"moment_bytes": moments, "moment_elements": moment_elems, "moment_dtypes": sorted(dtypes),
            "step_bytes": step_bytes}


def inner_optimizer(optimizer):
    while not isinstance(optimizer, torch.optim.Optimizer) or type(optimizer).__module__.startswith("deepspeed"):
        optimizer = optimizer.optimizer
    return optimizer


def measure(trainer, model_path: str) -> dict:
    accelerator = trainer.accelerator
    wrapped = trainer.model_wrapped
    stage = wrapped.zero_optimization_stage() if hasattr(wrapped, "zero_optimization_stage") else None
    module = wrapped.module if stage is not None else trainer.model
    out = {"rank": accelerator.process_index, "world_size": accelerator.num_processes, "model_path": model_path,
           "zero_stage": stage}
    params = list(module.parameters())  # tied weights appear once
    out["parameter_tensors"] = len(params)
    held = held_elems = persistent_elems = global_elems = 0
    dtypes = set()
    if stage == 3:
        for p in params:
            held += tensor_bytes(p.ds_tensor)
            held_elems += p.ds_tensor.numel()
            global_elems += p.ds_numel
            dtypes.add(str(p.ds_tensor.dtype))
            if getattr(p, "ds_persist", False):
                persistent_elems += p.ds_numel
        out["persistent_full_elements"] = persistent_elems  # also held whole, beside their partition
        out["persistent_full_bytes"] = persistent_elems * params[0].ds_tensor.element_size()
    else:
        for p in params:
            local = p.to_local() if isinstance(p, DTensor) else p
            held += tensor_bytes(local)
            held_elems += local.numel()
            global_elems += p.numel()
            dtypes.add(str(local.dtype))
    out.update(param_bytes=held, param_elements=held_elems, param_dtypes=sorted(dtypes), global_elements=global_elems)
    out["dtensor_parameters"] = any(isinstance(p, DTensor) for p in params)

    if stage is None:
        out["optimizer"] = optimizer_state(inner_optimizer(trainer.optimizer))
        out["optimizer"]["master_bytes"] = 0
        out["optimizer"]["master_elements"] = 0
    else:
        zero = wrapped.optimizer
        masters = zero.single_partition_of_fp32_groups if stage in (1, 2) else zero.fp32_partitioned_groups_flat
        inner = zero.optimizer
        out["optimizer"] = optimizer_state(inner)
        out["optimizer"]["master_bytes"] = sum(tensor_bytes(t) for t in masters)
        out["optimizer"]["master_elements"] = sum(t.numel() for t in masters)
        out["optimizer"]["master_dtypes"] = sorted({str(t.dtype) for t in masters})
        out["optimizer_class"] = type(zero).__name__
        if stage in (1, 2):
            rank = torch.distributed.get_rank()
            out["bit16_partition_elements"] = sum(groups[rank].numel() for groups in zero.parallel_partitioned_bit16_groups)
            out["bit16_flat_elements"] = sum(t.numel() for t in zero.bit16_groups_flat)
    return out


def main(argv: list[str] | None = None) -> None:
    run, trainer, _ = prepare(argv)
    trainer.train()
    report = measure(trainer, model_folder.resolve_model_path(run))
    Path(trainer.args.output_dir, f"sharding-probe-rank{report['rank']}.json").write_text(json.dumps(report))
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    exit_on_user_error(main)
