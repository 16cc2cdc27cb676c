"""Load time and peak memory of GPT-OSS-20B from an MXFP4 checkpoint, beside the planner's estimate of its weights.

Writes the real architecture (finetune/model_configs/gpt-oss-20b.json) with random weights the way openai/gpt-oss-20b
is stored (experts as MXFP4 blocks and scales, the rest bf16, 4 GiB shards), then loads it in a fresh process the way
scripts/sft.py does (the recipe's from_pretrained arguments: Mxfp4Config(dequantize=True), bf16, on the CPU) and
moves it to the GPU, and once more with device_map="cuda" (dequantized on the GPU). Each load checks the first
layer's experts against benchmarks/mxfp4_checkpoints.py's own dequantization of the stored bytes.

    python benchmarks/mxfp4_load_check.py                    # on the H200: 24 layers, ~13 GB written to --folder
    python benchmarks/mxfp4_load_check.py --layers 1 --device cpu   # the same path on a CPU (~4 GB of memory)
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from finetune.planner import architecture, memory, setup
from finetune.run import model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml"
GIB = 1024**3


def write_random_checkpoint(folder: Path, layers: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks import mxfp4_checkpoints
    from finetune.families import load_architecture

    config = load_architecture("gpt-oss-20b")
    config.num_hidden_layers = layers
    config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    mxfp4_checkpoints.write_checkpoint(config, mxfp4_checkpoints.random_hub_tensors(shapes, generator, torch.float32),
                                       folder)


def measure(folder: Path, device: str, device_map: bool) -> dict:
    """One load as scripts/sft.py does it (or with device_map), in this process: seconds and peak memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks import mxfp4_checkpoints
    from finetune.run import arguments

    run = arguments.parse_args(["--config", str(RECIPE), "--model_name_or_path", str(folder), "--output_dir", "/tmp/unused"])
    kwargs = model.model_init_kwargs(run, str(folder))
    kwargs["dtype"] = torch.bfloat16  # the recipe's dtype (a CPU run trains in float32; the loading path is the same)
    kwargs["attn_implementation"] = "eager"  # loading only: the attention kernel does not change what is loaded
    kwargs.pop("experts_implementation", None)
    if device_map:
        kwargs["device_map"] = device
    start = time.monotonic()
    loaded = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    load_seconds = time.monotonic() - start
    loaded.to(device)
    if device == "cuda":
        torch.cuda.synchronize()
    total_seconds = time.monotonic() - start
    reference = mxfp4_checkpoints.stored_expert_weights(folder, layer=0)
    experts = loaded.model.layers[0].mlp.experts
    exact = all(torch.equal(getattr(experts, name.rsplit(".", 1)[-1]).cpu().float(), weight)
                for name, weight in reference.items())
    result = {
        "device_map": device if device_map else None,
        "dtype": str(next(loaded.parameters()).dtype),
        "from_pretrained_s": round(load_seconds, 1),
        "loaded_on_device_s": round(total_seconds, 1),
        "experts_match_reference": exact,
        "parameters_gib": round(sum(p.numel() * p.element_size() for p in loaded.parameters()) / GIB, 3),
        "cpu_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2),
    }
    if device == "cuda":
        result["gpu_allocated_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
        result["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        result["gpu_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
    return result


def planner_weights_gib(layers: int) -> float:
    from finetune.config.files import read_recipe

    model = architecture.architecture_of("openai/gpt-oss-20b")
    model = replace(model, layers=layers) if layers != model.layers else model
    return round(memory.frozen_weight_bytes(model, setup.setup_from_recipe(read_recipe(str(RECIPE)))) / GIB, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers to write (24: the real GPT-OSS-20B)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/gpt-oss-20b-mxfp4-random"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--measure", choices=["recipe", "device_map"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = args.folder if args.layers == 24 else args.folder.with_name(f"{args.folder.name}-{args.layers}layers")
    if args.measure:
        print(json.dumps(measure(folder, args.device, args.measure == "device_map")))
        return
    if not (folder / "config.json").is_file():
        start = time.monotonic()
        write_random_checkpoint(folder, args.layers)
        print(f"wrote {folder} in {time.monotonic() - start:.0f} s", flush=True)
    stored_gib = sum(path.stat().st_size for path in folder.glob("*.safetensors")) / GIB
    results = {"layers": args.layers, "checkpoint_gib": round(stored_gib, 2),
               "planner_weights_gib": planner_weights_gib(args.layers)}
    for mode in ("recipe", "device_map"):
        command = [sys.executable, __file__, "--layers", str(args.layers), "--folder", str(args.folder),
                   "--device", args.device, "--measure", mode]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results[mode] = json.loads(output.strip().splitlines()[-1])
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
