"""Per-rank parameter and optimizer bytes under FSDP2 / ZeRO-2 / ZeRO-3 equal the planner's sharding formula, exactly.

Each strategy is one real `accelerate launch --config_file accelerate_configs/X.yaml --num_processes 2` of
tests/sharding_probe.py (scripts/sft.py's path, then trainer.train() for one step of the tiny Llama of
recipes/llama-3.2-1b/full.yaml), which writes what each rank holds into one file per rank. The expected numbers come from finetune/planner/:
its parameter count for the tiny model's config.json (`architecture.total_params`) and its per-GPU `weights` / `optimizer`
parts (`memory.estimate`), with the rounding each implementation really applies when it splits P elements over n ranks:

  FSDP2 (torch fully_shard): every parameter is split on dim 0 as torch.chunk does: rank r holds
      max(0, min(ceil(d0/n), d0 - r*ceil(d0/n))) rows (to_local(); the padding to ceil(d0/n) rows lives only in
      FSDP's internal buffer). Adam's exp_avg and exp_avg_sq are DTensors shaped like the local shards.
  ZeRO-2 (DeepSpeed stage 1/2): parameters are whole on every rank. All trainable parameters are flattened into one
      buffer padded to a multiple of 2*n elements (nccl_start_alignment_factor 2 x world size); each rank's fp32
      master partition, and Adam's two moments over it, have ceil(P / 2n) * 2 elements.
  ZeRO-3 (DeepSpeed stage 3): each parameter is padded to a multiple of n and split evenly: ds_tensor has
      ceil(numel/n) elements on every rank; the fp32 master flat and Adam's moments are the sum of those. Besides
      its partition, a rank keeps a full copy of every "persistent" parameter (numel <= stage3_param_persistence
      threshold, "auto" = 10 * hidden in transformers): the norms. The planner does not count those copies; they
      are asserted separately (here 5 norms x hidden elements).

On the tiny Llama (hidden 64, kv dim 32, intermediate 128, vocab 1000, tied embeddings) every dim 0 and P = 138048 are
multiples of 2*n = 4, so all three rules give exactly P/n = 69024 elements per rank, which is the planner's
`total_params / n`. Bytes: the CPU run trains in float32 (finetune/models/cpu.py turns bf16 off), so every tensor here is
4 bytes per element. The planner's FSDP2 weights (fp32, accelerate upcasts) and all optimizer parts (fp32 master +
2 fp32 moments under DeepSpeed, 2 moments in the parameter dtype under FSDP2) are dtype-exact and compared in bytes.
Its DeepSpeed `weights` part assumes bf16 (2 bytes per element, hard-coded in memory.estimate): it is compared as an
element count (bytes / 2) and the measured bytes are that count x 4, the float32 the CPU run really keeps.
Not counted by the planner and reported apart: Adam's `step` tensors (4 bytes per parameter tensor under FSDP2,
8 bytes per group under DeepSpeed).

    cd /work/main && HF_HUB_OFFLINE=1 /work/venv/bin/python -m pytest tests/test_plan_sharding.py -x -q
"""

import json
import math
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from finetune.config.files import read_recipe
from finetune.planner import architecture, memory, setup
from tests.helpers import ACCELERATE, ROOT, free_port

# one worker: its launches are module fixtures
pytestmark = [pytest.mark.launches, pytest.mark.xdist_group("test_plan_sharding")]

RECIPE = "recipes/llama-3.2-1b/full.yaml"
WORLD = 2
FP32 = 4
PLANNER_DEEPSPEED_WEIGHT_BYTES = 2  # memory.estimate: "params * 2" (bf16) for zero2/zero3 weights
TECHNIQUE = {"fsdp": "fsdp2", "zero2": "zero2", "zero3": "zero3"}


def probe(config: str, output_dir: Path) -> list[dict]:
    """Launch the probe with one shipped accelerate config and 2 processes; one dict per rank, rank order."""
    command = [ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
               "--num_processes", str(WORLD), "--main_process_port", str(free_port()),
               str(ROOT / "tests" / "sharding_probe.py"), "--config", RECIPE, "--tiny", "--max_steps", "1",
               "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none", "--output_dir", str(output_dir)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)} failed ({result.returncode}):\n{output[-6000:]}"
    reports = sorted(output_dir.glob("sharding-probe-rank*.json"))
    ranks = sorted((json.loads(path.read_text()) for path in reports), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(WORLD)), output[-4000:]
    return ranks


@pytest.fixture(scope="module", params=["fsdp", "zero2", "zero3"])
def measured(request, tmp_path_factory):
    return request.param, probe(request.param, tmp_path_factory.mktemp(request.param))


# --- The planner's side.


def planner_inputs(model_path: str) -> tuple[architecture.Architecture, setup.Setup]:
    """The tiny model's architecture from its config.json, and the recipe as the CPU run has it (float32, no bf16)."""
    a = architecture.architecture_of(model_path)
    s = setup.setup_from_recipe(read_recipe(ROOT / RECIPE))
    return a, replace(s, dtype="float32", bf16=False, use_liger_kernel=False)


def parameter_shapes(a: architecture.Architecture) -> list[tuple[int, ...]]:
    """Every trained tensor of a dense Llama in the planner's terms (out, in for nn.Linear); tied head counted once."""
    assert not a.is_moe and not a.attention_bias
    layer = [(a.attn_dim, a.hidden), (a.kv_dim, a.hidden), (a.kv_dim, a.hidden), (a.hidden, a.attn_dim),
             (a.intermediate, a.hidden), (a.intermediate, a.hidden), (a.hidden, a.intermediate), (a.hidden,), (a.hidden,)]
    shapes = [(a.vocab, a.hidden)] + layer * a.layers + [(a.hidden,)]
    if not a.tied_embeddings:
        shapes.append((a.vocab, a.hidden))
    assert sum(math.prod(shape) for shape in shapes) == architecture.total_params(a)  # the planner's own count
    return shapes


def fsdp2_local_elements(shapes, world: int, rank: int) -> int:
    total = 0
    for shape in shapes:
        rows = math.ceil(shape[0] / world)
        total += max(0, min(rows, shape[0] - rank * rows)) * math.prod(shape[1:])
    return total


def zero2_partition_elements(params: int, world: int) -> int:
    alignment = 2 * world  # DeepSpeedZeroOptimizer.nccl_start_alignment_factor * dp world size
    return math.ceil(params / alignment) * alignment // world


def zero3_partition_elements(shapes, world: int) -> int:
    return sum(math.ceil(math.prod(shape) / world) for shape in shapes)


def zero3_persistent_elements(a: architecture.Architecture, shapes) -> int:
    threshold = 10 * a.hidden  # transformers' "auto" stage3_param_persistence_threshold
    return sum(math.prod(shape) for shape in shapes if math.prod(shape) <= threshold)


# --- The test.


def test_per_rank_bytes_match_the_planner(measured):
    config, ranks = measured
    technique = TECHNIQUE[config]
    a, s = planner_inputs(ranks[0]["model_path"])
    shapes = parameter_shapes(a)
    params = architecture.total_params(a)
    parts = memory.estimate(a, s, technique, WORLD).parts
    for r in ranks:
        assert r["world_size"] == WORLD and r["global_elements"] == params, r
        assert r["param_dtypes"] == ["torch.float32"], r
        optimizer = r["optimizer"]
        assert optimizer["moment_dtypes"] == ["torch.float32"], r
        held_optimizer = optimizer["master_bytes"] + optimizer["moment_bytes"]
        if technique == "fsdp2":
            assert r["dtensor_parameters"] and r["zero_stage"] is None, r
            local = fsdp2_local_elements(shapes, WORLD, r["rank"])
            assert local == params // WORLD  # no uneven chunk on this model
            assert r["param_elements"] == local, r
            assert r["param_bytes"] == local * FP32 == parts["weights"], (r, parts)
            assert optimizer["moment_elements"] == 2 * local, r  # exp_avg + exp_avg_sq
            assert held_optimizer == 2 * local * FP32 == parts["optimizer"], (r, parts)
        elif technique == "zero2":
            assert r["zero_stage"] == 2, r
            partition = zero2_partition_elements(params, WORLD)
            assert partition == params // WORLD  # P is a multiple of 2 * world: no padding
            assert r["param_elements"] == params, r  # ZeRO-2 keeps the whole model on every rank
            assert params == parts["weights"] / PLANNER_DEEPSPEED_WEIGHT_BYTES, parts
            assert r["param_bytes"] == params * FP32, r  # float32 on CPU (the planner's bf16: 2 bytes)
            assert r["bit16_partition_elements"] == partition, r
            assert optimizer["master_elements"] == partition and optimizer["moment_elements"] == 2 * partition, r
            assert held_optimizer == 3 * partition * FP32 == parts["optimizer"], (r, parts)
        else:
            assert r["zero_stage"] == 3, r
            partition = zero3_partition_elements(shapes, WORLD)
            assert partition == params // WORLD  # every tensor's numel is a multiple of world: no padding
            assert r["param_elements"] == partition == parts["weights"] / PLANNER_DEEPSPEED_WEIGHT_BYTES, (r, parts)
            assert r["param_bytes"] == partition * FP32, r  # float32 on CPU (the planner's bf16: 2 bytes)
            # Not in the planner: full copies of the persistent small parameters (the 2 * layers + 1 norms).
            assert r["persistent_full_elements"] == zero3_persistent_elements(a, shapes) == (2 * a.layers + 1) * a.hidden, r
            assert optimizer["master_elements"] == partition and optimizer["moment_elements"] == 2 * partition, r
            assert held_optimizer == 3 * partition * FP32 == parts["optimizer"], (r, parts)
        print(f"{config} rank {r['rank']}: params {r['param_bytes']} B ({r['param_elements']} el), optimizer "
              f"{held_optimizer} B (master {optimizer['master_bytes']} + moments {optimizer['moment_bytes']}); "
              f"planner weights {parts['weights']:.0f} B, optimizer {parts['optimizer']:.0f} B")
