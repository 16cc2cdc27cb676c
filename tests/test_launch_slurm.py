"""scripts/launch.slurm builds, on every node, the accelerate command for a multi-node run from SLURM's variables.

SLURM itself is not needed: a fake `srun` runs the per-node command once per node (with that node's SLURM_NODEID,
concurrently, as srun does) and a fake `scontrol` expands the node list.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.launches  # its tests start training processes

SCRIPT = ROOT / "scripts" / "launch.slurm"

FAKE_SRUN = """#!/bin/bash
# Fake srun: run `bash -c COMMAND` once per node, concurrently, each with its own SLURM_NODEID/SLURM_PROCID.
echo "srun $*" >> "$FAKE_SLURM_LOG"
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$FAKE_SLURM_LOG.node$node" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""

FAKE_SCONTROL = """#!/bin/bash
# Fake scontrol: `scontrol show hostnames LIST` prints FAKE_HOSTNAMES one per line.
[ "$1 $2" = "show hostnames" ] || exit 1
for host in $FAKE_HOSTNAMES; do echo "$host"; done
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "slurm.log"

    def run(*args, hostnames="gpu-node-07 gpu-node-08", **env):
        environment = {
            key: value for key, value in os.environ.items()
            if not key.startswith(("SLURM_", "NCCL_", "GPUS_PER_NODE", "MASTER_PORT", "FINETUNE_SLURM"))
        }
        environment.update(
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_LOG=str(log), FAKE_HOSTNAMES=hostnames,
            SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu-node-[07-08]", SLURM_GPUS_ON_NODE="8",
        )
        environment.update(env)
        environment = {key: value for key, value in environment.items() if value != ""}  # "" means unset
        result = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=environment,
                                capture_output=True, text=True, timeout=600)
        nodes = int(environment.get("SLURM_NNODES", 0))
        node_outputs = [Path(f"{log}.node{node}").read_text() if Path(f"{log}.node{node}").exists() else ""
                        for node in range(nodes)]
        return result, node_outputs, log.read_text() if log.exists() else ""

    return run


def test_slurm_script_builds_one_accelerate_launch_per_node(fake_slurm):
    result, nodes, srun_calls = fake_slurm(
        "recipes/llama-3.2-3b/full.yaml", "accelerate_configs/zero3.yaml", "--max_steps", "10",
        "--sample_prompt", "Count from 3 to 7.", FINETUNE_SLURM_ECHO="1",
    )
    assert result.returncode == 0, result.stderr
    assert "--ntasks-per-node=1" in srun_calls and "--nodes=2" in srun_calls
    for rank, output in enumerate(nodes):
        words = output.split()
        assert words[:2] == ["accelerate", "launch"], output
        flags = dict(zip(words[2:], words[3:]))
        assert flags["--config_file"] == "accelerate_configs/zero3.yaml"
        assert flags["--num_machines"] == "2"
        assert flags["--machine_rank"] == str(rank)
        assert flags["--num_processes"] == "16"  # 2 nodes x 8 GPUs
        assert flags["--main_process_ip"] == "gpu-node-07"  # the first host of the allocation
        assert flags["--main_process_port"] == "29500"
        assert output.rstrip().endswith(
            "scripts/sft.py --config recipes/llama-3.2-3b/full.yaml --max_steps 10 --sample_prompt Count from 3 to 7."
        ), output


def test_slurm_script_exports_nccl_settings_and_keeps_arguments_quoted(fake_slurm, tmp_path):
    # Without echo mode, the per-node command runs: a fake `accelerate` shows its arguments and environment.
    fake = tmp_path / "accelerate"
    fake.write_text('#!/bin/bash\necho "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE $TORCH_SYMM_MEM_DISABLE_MULTICAST $NVSHMEM_DISABLE_NVLS"\nfor arg in "$@"; do echo "ARG:$arg"; done\n')
    fake.chmod(0o755)
    result, nodes, _ = fake_slurm(
        "recipes/llama-3.2-1b/lora.yaml", "accelerate_configs/ddp.yaml", "--sample_prompt", "Count from 3 to 7.",
        ACCELERATE=str(fake), SLURM_GPUS_ON_NODE="", SLURM_GPUS_PER_NODE="h100:4", MASTER_PORT="31234",
    )
    assert result.returncode == 0, result.stderr
    for rank, output in enumerate(nodes):
        assert "NCCL_NVLS_ENABLE=0 1 1" in output, "NVLink multicast off for NCCL, torch symmetric memory and NVSHMEM"
        arguments = [line[4:] for line in output.splitlines() if line.startswith("ARG:")]
        assert "Count from 3 to 7." in arguments  # one argument, spaces kept
        assert arguments[arguments.index("--num_processes") + 1] == "8"  # SLURM_GPUS_PER_NODE=h100:4, 2 nodes
        assert arguments[arguments.index("--machine_rank") + 1] == str(rank)
        assert arguments[arguments.index("--main_process_port") + 1] == "31234"


def test_slurm_script_refuses_to_run_outside_an_allocation(fake_slurm):
    result, _, _ = fake_slurm("recipes/llama-3.2-1b/lora.yaml", "accelerate_configs/ddp.yaml", SLURM_NNODES="")
    assert result.returncode != 0
    assert "not inside a SLURM allocation" in result.stderr


def test_slurm_script_trains_two_nodes_on_one_host(fake_slurm, tmp_path):
    """The command it builds really trains: two 'nodes' on this host, one CPU process each, DDP over gloo."""
    accelerate = Path(sys.executable).with_name("accelerate")
    output_dir = tmp_path / "out"
    result, nodes, _ = fake_slurm(
        "recipes/llama-3.2-1b/full.yaml", "accelerate_configs/ddp.yaml", "--tiny", "--output_dir", str(output_dir),
        "--max_steps", "2", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none",
        "--per_device_train_batch_size", "4",
        hostnames="127.0.0.1", ACCELERATE=str(accelerate), GPUS_PER_NODE="1", HF_HUB_OFFLINE="1",
        MASTER_PORT=str(free_port()),
    )
    assert result.returncode == 0, f"{result.stderr}\n{nodes[0][-4000:]}\n{nodes[1][-4000:]}"
    assert '"world_size": 2' in nodes[0] and '"strategy": "ddp"' in nodes[0], nodes[0][-4000:]
    assert (output_dir / "model.safetensors").is_file()


def test_slurm_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
