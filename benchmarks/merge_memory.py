"""Host memory of `finetune merge` on a GPT-OSS MXFP4 base: the streamed merge (finetune/run/merging.py) against the
in-memory one (the base loaded dequantized, peft's merge_and_unload), each in a fresh process, on random MXFP4 weights
of a scaled-down GPT-OSS written in several shards, with a LoRA adapter on attention and experts. Linux only: the peak
is the process's VmHWM, reset (/proc/self/clear_refs) just before the merge.

    python benchmarks/merge_memory.py --folder /tmp/merge-memory [--layers 8 --hidden 512 --experts 16 --shard_mb 8]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def write_base_and_adapter(folder: Path, layers: int, hidden: int, experts: int, shard_bytes: int,
                           rank: int = 16) -> tuple[Path, Path]:
    """A random MXFP4 GPT-OSS of `layers` layers of width `hidden` (experts' width too) and `experts` experts in shards
    of at most `shard_bytes`, and a random LoRA adapter of `rank` on its attention projections and expert weights."""
    import safetensors.torch
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks import mxfp4_checkpoints
    from finetune.models import expert_lora, tiny

    tiny_folder = mxfp4_checkpoints.tiny_checkpoint()
    config = AutoConfig.from_pretrained(tiny_folder)
    del config.quantization_config
    config.num_hidden_layers, config.layer_types = layers, (config.layer_types * layers)[:layers]
    config.hidden_size = config.intermediate_size = hidden
    config.num_local_experts = experts
    config.num_attention_heads, config.num_key_value_heads = hidden // config.head_dim, 2
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {name: tensor.shape for name, tensor in skeleton.state_dict().items()}
    base = folder / "base"
    mxfp4_checkpoints.write_checkpoint(config, mxfp4_checkpoints.random_hub_tensors(shapes, torch.Generator()
                                                                                    .manual_seed(0)),
                                       base, shard_bytes=shard_bytes)
    tiny.build_tiny_tokenizer("gpt-oss").save_pretrained(base)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=list(expert_lora.EXPERT_WEIGHTS), base_model_name_or_path=str(base))
    generator = torch.Generator().manual_seed(1)
    shapes = {name: tensor.shape for name, tensor in get_peft_model_state_dict(get_peft_model(skeleton, lora)).items()}
    adapter = folder / "adapter"
    adapter.mkdir()
    weights = {name: torch.randn(shape, generator=generator) * 0.01 for name, shape in shapes.items()}
    safetensors.torch.save_file(weights, str(adapter / "adapter_model.safetensors"))
    lora.save_pretrained(adapter)
    return base, adapter


def measurable() -> bool:
    import ctypes

    return Path("/proc/self/clear_refs").exists() and hasattr(ctypes.CDLL(None), "mallopt")  # Linux with glibc


def serve_large_allocations_from_mmap() -> None:
    """glibc serves allocations of 1 MiB and more from mmap and returns them on free, as it always does for the
    gigabyte tensors of a real model; its default threshold grows with what is freed (up to 32 MiB), keeping a
    small model's freed tensors in the heap, where they would count as resident."""
    import ctypes

    mmap_threshold = -3  # M_MMAP_THRESHOLD in malloc.h
    ctypes.CDLL(None).mallopt(mmap_threshold, 1 << 20)


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def merge_peak(base: Path, adapter: Path, output: Path, streamed: bool) -> dict:
    """Merge in this process; the peak host memory above what the process held just before, in bytes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from finetune.commands import merge
    from finetune.run import merging  # noqa: F401  (its imports, trl's among them, are not the merge's memory)

    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = rss_bytes()
    if streamed:
        merge.merge_adapter(str(adapter), str(output), str(base))
    else:  # the merge before the streamed one: the base loaded dequantized, merged by peft in memory
        loaded = AutoModelForCausalLM.from_pretrained(base, dtype="auto",
                                                      quantization_config=Mxfp4Config(dequantize=True))
        PeftModel.from_pretrained(loaded, adapter).merge_and_unload().save_pretrained(output)
    return {"peak_above_start_bytes": peak_rss_bytes() - before}


def shard_bytes(folder: Path) -> list[int]:
    return sorted(path.stat().st_size for path in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, required=True, help="a new folder for the base, adapter and outputs")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--shard_mb", type=float, default=8)
    parser.add_argument("--merge", choices=["streamed", "in-memory"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.merge:  # one measurement, in a fresh process
        serve_large_allocations_from_mmap()
        output = args.folder / f"merged-{args.merge}"
        print(json.dumps(merge_peak(args.folder / "base", args.folder / "adapter", output, args.merge == "streamed")))
        return
    write_base_and_adapter(args.folder, args.layers, args.hidden, args.experts, int(args.shard_mb * 2**20))
    report = {"input_shards_bytes": shard_bytes(args.folder / "base")}
    for mode in ("streamed", "in-memory"):
        result = subprocess.run([sys.executable, __file__, "--folder", str(args.folder), "--merge", mode],
                                capture_output=True, text=True, check=True)
        report[mode] = json.loads(result.stdout.strip().splitlines()[-1])
        report[mode]["output_shards_bytes"] = shard_bytes(args.folder / f"merged-{mode}")
    report["bit_equal"] = same_tensors(args.folder / "merged-streamed", args.folder / "merged-in-memory")
    print(json.dumps(report, indent=2))


def same_tensors(folder: Path, other: Path) -> bool:
    """Whether the two folders hold the same tensor names, dtypes and bits."""
    import torch
    from safetensors.torch import load_file

    def tensors(path: Path) -> dict:
        loaded = {}
        for shard in path.glob("*.safetensors"):
            loaded.update(load_file(str(shard)))
        return loaded

    these, those = tensors(folder), tensors(other)
    return these.keys() == those.keys() and all(
        these[name].dtype == those[name].dtype
        and torch.equal(these[name].view(torch.uint8), those[name].view(torch.uint8)) for name in these)


if __name__ == "__main__":
    main()
