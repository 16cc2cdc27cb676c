"""Which technique (DDP, FSDP2, ZeRO-2, ZeRO-3, ZeRO-3 offload) on which GPUs: a per-GPU peak-memory model.

`finetune plan --config recipes/X.yaml --gpus 8 --gpu H100` reads the recipe and the model's architecture (the
project's copy of the hub config, or a local folder's config.json), estimates the peak memory of one GPU for each
technique, and picks the cheapest one that fits with a safety margin. It reads the recipe as the run does
(`setup_from_recipe`: what the recipe leaves out is the run's default). Only json/yaml are imported here, never torch
or transformers: the answer comes in well under a second.

How the peak is built (all per GPU, bytes), see docs/planner.md for the measurements behind the constants:

    static    = weights + optimizer states (+ DDP gradient buckets, + fp32 master copies where the technique keeps them)
    backward  = max(activations saved by the forward + head gradients + one layer's backward transients,
                    all gradients                                      + one layer's backward transients)
    allocated = static + backward + gathered layers (FSDP/ZeRO-3) + LM-head loss buffers
    reserved  = allocated * allocator fragmentation
    per GPU   = reserved + fixed CUDA context / NCCL / cuBLAS overhead (outside PyTorch's allocator)

With activation offloading (TRL's `activation_offloading`) the saved activations wait in pinned CPU memory for the
backward: with checkpointing the layer inputs, all but the last few still copying out; without it every layer's
activations, one layer brought back at a time.

Gradients are not counted on top of the full activations: `optimizer.zero_grad(set_to_none=True)` frees them before
each step, and backward creates a layer's gradients while it frees that layer's saved activations, so the two grow
and shrink against each other and the peak is at one end of the backward pass.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass, field, replace

from finetune.errors import UserError
from finetune.planner.architecture import Architecture, architecture_of
from finetune.planner.memory import (
    CONFIG_FILES,
    GIB,
    LABELS,
    SAFETY_MARGIN,
    TECHNIQUES,
    Estimate,
    activation_bytes,
    estimate,
    mxfp4_resident,
)
from finetune.planner.setup import Setup, setup_from_recipe

# name: (marketing GB, GiB that PyTorch can see on the card: nvidia-smi's total)
KNOWN_GPUS = {
    "A10": (24, 22.5),
    "L4": (24, 22.5),
    "A100-40": (40, 40.0),
    "A100-80": (80, 80.0),
    "H100": (80, 79.6),
    "H200": (141, 140.4),
    "B200": (180, 179.0),
}


GPU_ALIASES = {"A100": "A100-80", "A100-40GB": "A100-40", "A100-80GB": "A100-80", "H100-80": "H100", "H200-141": "H200"}


# What a technique holds in host memory, said when the host is short of it (memory.host_bytes)
HOST_NEEDS = {"fsdp2": "one process loads the whole model to send the others their shards",
              "zero3_offload": "the 16-bit model, fp32 master weights and optimizer states live there",
              "ddp": "offloaded activations", "zero2": "offloaded activations", "zero3": "offloaded activations"}


# ---- The choice --------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    model: str
    method: str
    gpu: str
    gpu_memory_gib: float
    gpus_per_node: int
    nodes: int
    estimates: dict[str, Estimate]
    technique: str | None
    fits: bool
    command: str | None
    suggestions: list[str] = field(default_factory=list)
    offloaded_gib: float = 0.0  # pinned CPU memory per process that activation offloading fills
    host_memory_gib: float = math.inf  # of one node: a technique needing more is never chosen

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "method": self.method,
            "gpu": self.gpu,
            "gpu_memory_gib": self.gpu_memory_gib,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "technique": self.technique,
            "config_file": CONFIG_FILES.get(self.technique) if self.technique else None,
            "fits": self.fits,
            "command": self.command,
            "per_gpu_gib": {t: round(e.per_gpu_gib, 2) for t, e in self.estimates.items()},
            "supported": {t: e.supported for t, e in self.estimates.items()},
            "breakdown_gib": {t: {k: round(v / GIB, 3) for k, v in e.parts.items()} for t, e in self.estimates.items()},
            "budget_gib": round(self.gpu_memory_gib * SAFETY_MARGIN, 2),
            "suggestions": self.suggestions,
            "offloaded_to_cpu_gib": round(self.offloaded_gib, 2),
            "host_memory_gib": round(self.host_memory_gib, 2),
            "host_needed_gib": {t: round(e.host / GIB, 2) for t, e in self.estimates.items()},
        }


def resolve_gpu(name: str | None, memory_gib: float | None) -> tuple[str, float]:
    if memory_gib is not None:
        return (name or "custom", float(memory_gib))
    if name is None:
        raise UserError("command line: no GPU given; pass --gpu NAME or --gpu-memory GIB.")
    key = name.upper().replace(" ", "")
    key = GPU_ALIASES.get(key, key)
    if key not in KNOWN_GPUS:
        raise UserError(f"command line: `--gpu {name}` is not a GPU the planner knows ({', '.join(KNOWN_GPUS)}); "
                        f"give one of them, or the memory of one GPU with --gpu-memory GIB.")
    return key, KNOWN_GPUS[key][1]


def this_host_memory_gib() -> float:
    """The physical memory of the machine the planner runs on (os.sysconf: no psutil, no torch)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def launch_command(technique: str, recipe: str, world: int, nodes: int, extra_args: list[str] | None = None) -> str:
    parts = ["accelerate", "launch", "--config_file", CONFIG_FILES[technique]]
    if nodes > 1:
        parts += ["--num_machines", str(nodes), "--machine_rank", "$RANK", "--main_process_ip", "$MASTER_ADDR",
                  "--main_process_port", "29500"]
    parts += ["--num_processes", str(world), "scripts/sft.py", "--config", recipe] + list(extra_args or [])
    return " ".join(p if p.startswith("$") else shlex.quote(p) for p in parts)


def choose(a: Architecture, s: Setup, world: int, budget_bytes: float, host_bytes: float = math.inf,
           gpus_per_node: int | None = None) -> tuple[dict[str, Estimate], str | None]:
    """Cheapest first: DDP (no sharding traffic), ZeRO-2 (shards only optimizer state and gradients), FSDP2 then
    ZeRO-3 (also shard the weights, gather each layer on the fly), ZeRO-3 with CPU offload (slowest, PCIe bound).
    With one GPU sharding saves nothing, so only DDP (a plain single process) and offload are candidates. A technique
    whose node needs more than `host_bytes` of host memory is never chosen."""
    estimates = {t: estimate(a, s, t, world, gpus_per_node) for t in TECHNIQUES}
    order = TECHNIQUES if world > 1 else ("ddp", "zero3_offload")
    for t in order:
        e = estimates[t]
        if e.supported and e.per_gpu <= budget_bytes and e.host <= host_bytes:
            return estimates, t
    return estimates, None


def suggestions(a: Architecture, s: Setup, world: int, gpus_per_node: int, budget: float,
                host: float = math.inf) -> list[str]:
    """What would fit, tried one change at a time, cheapest change first."""

    def fits(changed: Setup, total: int = world, per_node: int = gpus_per_node) -> bool:
        return choose(a, changed, total, budget, host, per_node)[1] is not None

    out = []
    if mxfp4_resident(a, s) and world > 1 and fits(replace(s, dequantize_mxfp4=True)):
        out.append("the experts dequantized, which shards: --dequantize_mxfp4 true")
    if a.mxfp4_experts and s.dequantize_mxfp4 and world == 1 and fits(replace(s, dequantize_mxfp4=False)):
        out.append("the experts resident in MXFP4 (one process): --dequantize_mxfp4 false")
    checkpointing_fits = fits(replace(s, gradient_checkpointing=True))
    if not s.gradient_checkpointing and checkpointing_fits:
        out.append("turn on activation checkpointing: --gradient_checkpointing true")
    offloaded = replace(s, gradient_checkpointing=True, activation_offloading=True)
    if not checkpointing_fits and not s.activation_offloading and fits(offloaded):
        out.append("checkpointing with the layer inputs in CPU memory: --gradient_checkpointing true "
                   "--activation_offloading true")
    if s.batch > 1:
        for b in range(s.batch - 1, 0, -1):
            if fits(replace(s, batch=b)):
                out.append(f"a smaller micro-batch: --per_device_train_batch_size {b} (raise gradient_accumulation_steps)")
                break
    length = s.max_length // 2
    while length >= 256:
        if fits(replace(s, max_length=length)):
            out.append(f"shorter sequences: --max_length {length}")
            break
        length //= 2
    if s.method == "full":
        lora = replace(s, method="lora", lora_target_modules=("all-linear",))
        if fits(lora):
            out.append("LoRA instead of full fine-tuning: --use_peft true --lora_target_modules all-linear")
    if s.method != "full":
        # The largest rank below the recipe's that fits, with its optimizer or with bitsandbytes' 8-bit AdamW (a
        # dependency; torchao's needs the fp8 extra), whichever allows the larger rank
        options = [(s, "")] + ([] if "8bit" in s.optim else [(replace(s, optim="adamw_8bit"), " --optim adamw_8bit")])
        ranks = [(next((r for r in range(s.lora_r - 1, 0, -1) if fits(replace(option, lora_r=r))), 0), flag)
                 for option, flag in options]
        rank, flag = max(ranks, key=lambda found: found[0])
        if rank:
            out.append(f"a smaller LoRA rank: --lora_r {rank}{flag}")
    if s.method in ("full", "lora") and not a.is_moe:
        qlora = replace(s, method="qlora", lora_target_modules=s.lora_target_modules or ("all-linear",))
        if fits(qlora):
            out.append("QLoRA (4-bit base weights): --use_peft true --load_in_4bit true")
    per_node = max(gpus_per_node, 8)  # more GPUs: fill a node of 8, then add nodes of 8
    sharded = replace(s, dequantize_mxfp4=True)  # resident experts are one process's: more GPUs need them dequantized
    for total in (2, 4, 8, 16, 32, 64, 128):
        if total <= world or not fits(sharded, total, min(total, per_node)):
            continue
        nodes = math.ceil(total / per_node)
        out.append(f"more GPUs: {total} of this kind" + (f" ({nodes} nodes of {per_node}, --nodes {nodes})" if nodes > 1 else "")
                   + (" with --dequantize_mxfp4 true" if mxfp4_resident(a, s) else ""))
        break
    if not out:
        out.append("no single change fits: combine checkpointing, LoRA/QLoRA, shorter sequences, more or larger GPUs")
    return out


def faster_than_offload(a: Architecture, s: Setup, world: int, technique: str, budget: float, host: float,
                        gpus_per_node: int) -> list[str]:
    """When only ZeRO-3 offload fits (PCIe bound), checkpointing on the GPU is usually much faster if it fits without
    offload: say so beside the command."""
    if technique != "zero3_offload" or s.gradient_checkpointing:
        return []
    _, checkpointed = choose(a, replace(s, gradient_checkpointing=True), world, budget, host, gpus_per_node)
    if checkpointed in (None, "zero3_offload"):
        return []
    return [f"activation checkpointing fits {LABELS[checkpointed]} without offloading, usually much faster: "
            f"--gradient_checkpointing true ({CONFIG_FILES[checkpointed]})"]


def plan(recipe_values: dict, gpus: int, gpu: str | None = None, gpu_memory_gib: float | None = None,
         nodes: int = 1, recipe_path: str = "RECIPE", extra_args: list[str] | None = None,
         host_memory_gib: float | None = None) -> Plan:
    """The plan on `nodes` machines of `gpus` GPUs each, with `host_memory_gib` of host memory each (this machine's
    when not given)."""
    s = setup_from_recipe(recipe_values, recipe_path)
    a = architecture_of(s.model, recipe_path)
    gpu_name, memory = resolve_gpu(gpu, gpu_memory_gib)
    world = gpus * nodes
    budget = memory * GIB * SAFETY_MARGIN
    host_gib = this_host_memory_gib() if host_memory_gib is None else float(host_memory_gib)
    host = host_gib * GIB
    estimates, technique = choose(a, s, world, budget, host, gpus)
    command = launch_command(technique, recipe_path, world, nodes, extra_args) if technique else None
    tips = suggestions(a, s, world, gpus, budget, host) if technique is None else faster_than_offload(
        a, s, world, technique, budget, host, gpus)
    return Plan(s.model, s.method, gpu_name, memory, gpus, nodes, estimates, technique, technique is not None,
                command, tips, activation_bytes(a, s)["offloaded_to_cpu"] / GIB, host_gib)


def format_plan(p: Plan) -> str:
    budget = p.gpu_memory_gib * SAFETY_MARGIN
    lines = [
        f"{p.model} ({p.method}) on {p.nodes} node{'s' if p.nodes > 1 else ''} x {p.gpus_per_node} {p.gpu} "
        f"({p.gpu_memory_gib:.1f} GiB each; budget {budget:.1f} GiB = {SAFETY_MARGIN:.0%})",
        "",
        f"{'technique':<16}{'per GPU GiB':>12}  {'weights':>8} {'optim':>8} {'act/grad':>9} {'other':>8}  verdict",
    ]
    for t, e in p.estimates.items():
        w = e.parts.get("weights", 0) / GIB
        o = e.parts.get("optimizer", 0) / GIB
        ag = e.parts.get("activations_and_grads", 0) / GIB
        other = e.per_gpu_gib - w - o - ag
        if not e.supported:
            verdict = f"not supported ({e.note})"
        elif p.world == 1 and t not in ("ddp", "zero3_offload"):
            verdict = "(no sharding on 1 GPU)"
        elif e.per_gpu_gib > budget:
            verdict = "too big"
        elif e.host / GIB > p.host_memory_gib:
            verdict = f"needs {e.host / GIB:.0f} GiB of host memory per node ({HOST_NEEDS[t]}); the host has " \
                      f"{p.host_memory_gib:.0f} (--host-memory)"
        else:
            verdict = "fits"
        mark = "*" if t == p.technique else " "
        lines.append(f"{mark}{LABELS[t]:<15}{e.per_gpu_gib:>12.1f}  {w:>8.1f} {o:>8.1f} {ag:>9.1f} {other:>8.1f}  {verdict}")
    lines.append("")
    if p.offloaded_gib:
        lines += [f"Activation offloading keeps {p.offloaded_gib:.1f} GiB of activations in pinned CPU memory per GPU.",
                  ""]
    if p.fits:
        lines.append(f"Use {LABELS[p.technique]} ({CONFIG_FILES[p.technique]}):")
        lines.append(f"  {p.command}")
        lines += [f"  Faster: {tip}" for tip in p.suggestions]
    else:
        lines.append("Nothing fits. What would:")
        lines += [f"  - {tip}" for tip in p.suggestions]
    return "\n".join(lines)
