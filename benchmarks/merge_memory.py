"""Host memory of `finetune merge` on a GPT-OSS MXFP4 base: the streamed merge (finetune/run/merging.py), and on
models small enough the in-memory one (the base loaded dequantized, peft's merge_and_unload) to compare, each in a
fresh process, on random MXFP4 weights written as the hub stores them (benchmarks/mxfp4_checkpoints.py) with a random
LoRA adapter on attention and experts. Linux only: host memory is the process's resident set (VmRSS of
/proc/self/status: anonymous memory and the pages of mapped files, the stored shards' included), its high-water mark
VmHWM reset (/proc/self/clear_refs) just before the merge, read once peft has put the adapter on the model (the whole
adapter read) and again at the end.

    python benchmarks/merge_memory.py --folder /tmp/merge-memory [--layers 8 --hidden 512 --experts 16 --shard_mb 8]
    python benchmarks/merge_memory.py --folder /tmp/merge-memory-120b --real_widths --layers 2   # ~22 GB of disk

With --real_widths the layers are GPT-OSS-120B's (finetune/model_configs/gpt-oss-120b.json: 128 experts of width
2880, the 201,088-token vocabulary), stored in shards of 4 GiB as openai/gpt-oss-120b is, and the adapter has the
rank 3 unless --rank says otherwise (the 120B recipe's rank when the figures in docs/benchmarks.md were measured;
r4 since). The merge then holds what it holds at 120B, a chunk of experts of the real size and one module's adapter
weights, at any depth; only peft's read of the whole adapter at the start, and what the process keeps of it, grow
with the depth. So that read is measured on its own, on the meta model of all 36
layers with a random adapter of the same rank (0.75 GiB at r3, 4 GiB at r16, fp32 as peft saves it), and at 120B

    peak above start = max(adapter read, held after the adapter read + (merge peak - held after the adapter read
                           at the measured depth))

against two stored shards, 8 GiB.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


GIB = 1 << 30
HUB_SHARD_BYTES = 4 << 30  # openai/gpt-oss-120b's stored shards, as mxfp4_checkpoints writes them by default
REAL_LAYERS = 36


def scaled_config(layers: int, hidden: int, experts: int):
    """The tiny GPT-OSS's config with `layers` layers of width `hidden` (the experts' width too) and `experts`
    experts."""
    from transformers import AutoConfig

    from benchmarks import mxfp4_checkpoints

    config = AutoConfig.from_pretrained(mxfp4_checkpoints.tiny_checkpoint())
    del config.quantization_config
    config.num_hidden_layers, config.layer_types = layers, (config.layer_types * layers)[:layers]
    config.hidden_size = config.intermediate_size = hidden
    config.num_local_experts = experts
    config.num_attention_heads, config.num_key_value_heads = hidden // config.head_dim, 2
    return config


def real_config(layers: int):
    """GPT-OSS-120B's architecture cut to its first `layers` layers."""
    from finetune.families import load_architecture

    config = load_architecture("gpt-oss-120b")
    config.num_hidden_layers, config.layer_types = layers, config.layer_types[:layers]
    return config


def lora_config(rank: int, base: str = ""):
    from peft import LoraConfig

    from finetune.models import expert_lora

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=list(expert_lora.EXPERT_WEIGHTS), base_model_name_or_path=base)


def adapter_shapes(config, rank: int) -> dict:
    """The adapter's tensors on the model of `config`, as peft saves them."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
        return {name: tensor.shape for name, tensor in get_peft_model_state_dict(get_peft_model(skeleton, lora_config(
            rank))).items()}


def write_base_and_adapter(folder: Path, config, shard_bytes: int, rank: int = 16) -> tuple[Path, Path]:
    """A random MXFP4 GPT-OSS of `config` in shards of at most `shard_bytes`, and a random LoRA adapter of `rank` on
    its attention projections and expert weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks import mxfp4_checkpoints
    from finetune.models import tiny

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {name: tensor.shape for name, tensor in skeleton.state_dict().items()}
    base = folder / "base"
    mxfp4_checkpoints.write_checkpoint(config, mxfp4_checkpoints.random_hub_tensors(shapes, torch.Generator()
                                                                                    .manual_seed(0)),
                                       base, shard_bytes=shard_bytes)
    tiny.build_tiny_tokenizer("gpt-oss").save_pretrained(base)
    return base, write_adapter(folder / "adapter", config, rank, base)


def write_adapter(adapter: Path, config, rank: int, base: Path) -> Path:
    """A random LoRA adapter of `rank` on the attention projections and expert weights of the model of `config`."""
    import safetensors.torch
    import torch

    generator = torch.Generator().manual_seed(1)
    adapter.mkdir(parents=True)
    weights = {name: torch.randn(shape, generator=generator) * 0.01
               for name, shape in adapter_shapes(config, rank).items()}
    safetensors.torch.save_file(weights, str(adapter / "adapter_model.safetensors"))
    lora_config(rank, str(base)).save_pretrained(adapter)
    return adapter


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
    """Merge in this process: its resident size just before, and the peaks above it, in bytes; the streamed merge's
    split at the end of peft's read of the whole adapter, with what the process still held then."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from finetune.commands import merge
    from finetune.run import merging  # its imports, trl's among them, are not the merge's memory

    peaks, held = {}, {}
    adapter_on = merging.adapter_on

    def adapter_on_and_mark(*args, **kwargs):
        adapted = adapter_on(*args, **kwargs)
        peaks["adapter_read_peak_above_start_bytes"] = peak_rss_bytes() - before
        Path("/proc/self/clear_refs").write_text("5")
        held["held_after_adapter_read_bytes"] = rss_bytes() - before
        return adapted

    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = rss_bytes()
    if streamed:
        merging.adapter_on = adapter_on_and_mark
        try:
            merge.merge_adapter(str(adapter), str(output), str(base))
        finally:
            merging.adapter_on = adapter_on
        peaks["merge_peak_above_start_bytes"] = peak_rss_bytes() - before
    else:  # the merge before the streamed one: the base loaded dequantized, merged by peft in memory
        loaded = AutoModelForCausalLM.from_pretrained(base, dtype="auto",
                                                      quantization_config=Mxfp4Config(dequantize=True))
        PeftModel.from_pretrained(loaded, adapter).merge_and_unload().save_pretrained(output)
        peaks["merge_peak_above_start_bytes"] = peak_rss_bytes() - before
    return {"start_rss_bytes": before, **peaks, **held, "peak_above_start_bytes": max(peaks.values())}


def adapter_read_peak(config_folder: Path, adapter: Path) -> dict:
    """The streamed merge's first step alone, in this process: peft's read of the whole adapter onto the meta model of
    the config in `config_folder`; the peak above the resident size before and what is held after, in bytes."""
    from finetune.run import merging

    Path("/proc/self/clear_refs").write_text("5")
    before = rss_bytes()
    merging.adapter_on(merging.meta_model(config_folder)[1], str(adapter), str(config_folder))
    return {"adapter_read_peak_above_start_bytes": peak_rss_bytes() - before,
            "held_after_adapter_read_bytes": rss_bytes() - before}


def shard_bytes(folder: Path) -> list[int]:
    return sorted(path.stat().st_size for path in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, required=True, help="a new folder for the base, adapter and outputs")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--shard_mb", type=float, default=8)
    parser.add_argument("--rank", type=int, help="the adapter's rank (default 16; 3 with --real_widths, as "
                                                   "measured)")
    parser.add_argument("--real_widths", action="store_true",
                        help="GPT-OSS-120B's layers in 4 GiB shards (ignores --hidden, --experts, --shard_mb); the "
                             "streamed merge only, extrapolated to 120B")
    parser.add_argument("--merge", choices=["streamed", "in-memory", "adapter-read"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.merge:  # one measurement, in a fresh process
        serve_large_allocations_from_mmap()
        if args.merge == "adapter-read":
            print(json.dumps(adapter_read_peak(args.folder / "base", args.folder / "adapter")))
            return
        output = args.folder / f"merged-{args.merge}"
        print(json.dumps(merge_peak(args.folder / "base", args.folder / "adapter", output, args.merge == "streamed")))
        return
    if args.real_widths:
        config, stored_shard_bytes, rank = real_config(args.layers), HUB_SHARD_BYTES, args.rank or 3
    else:
        config, stored_shard_bytes = scaled_config(args.layers, args.hidden, args.experts), int(args.shard_mb * 2**20)
        rank = args.rank or 16
    write_base_and_adapter(args.folder, config, stored_shard_bytes, rank)
    report = {"layers": args.layers, "rank": rank, "input_shards_bytes": shard_bytes(args.folder / "base"),
              "adapter_bytes": shard_bytes(args.folder / "adapter")[0]}
    for mode in ("streamed",) if args.real_widths else ("streamed", "in-memory"):
        report[mode] = measured(args.folder, mode)
        report[mode]["output_shards_bytes"] = shard_bytes(args.folder / f"merged-{mode}")
    if args.real_widths:
        report["at_120b"] = extrapolated(report, args.folder / "at-120b", rank)
    else:
        report["bit_equal"] = same_tensors(args.folder / "merged-streamed", args.folder / "merged-in-memory")
    print(json.dumps(report, indent=2))


def measured(folder: Path, mode: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--folder", str(folder), "--merge", mode],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def extrapolated(report: dict, folder: Path, rank: int) -> dict:
    """The streamed merge's peak at 120B by the docstring's formula, against two of its 4 GiB stored shards: peft's
    read of the 120B adapter measured on the meta model of the 36 layers (the adapter written into `folder`, deleted
    after), the merge after it from `report`."""
    import shutil

    from benchmarks import mxfp4_checkpoints

    config = real_config(REAL_LAYERS)
    config.quantization_config = dict(mxfp4_checkpoints.QUANTIZATION_CONFIG)
    config_folder = folder / "base"
    config_folder.mkdir(parents=True)
    config.save_pretrained(config_folder)
    write_adapter(folder / "adapter", config, rank, config_folder)
    try:
        adapter_read = measured(folder, "adapter-read")
        adapter = shard_bytes(folder / "adapter")[0]
    finally:
        shutil.rmtree(folder)
    merge = report["streamed"]
    merge_above_held = merge["merge_peak_above_start_bytes"] - merge["held_after_adapter_read_bytes"]
    peak = max(adapter_read["adapter_read_peak_above_start_bytes"],
               adapter_read["held_after_adapter_read_bytes"] + merge_above_held)
    return {"adapter_bytes": adapter, **adapter_read, "merge_peak_above_held_bytes": merge_above_held,
            "peak_above_start_gib": round(peak / GIB, 2),
            "peak_rss_gib": round((peak + merge["start_rss_bytes"]) / GIB, 2),
            "two_stored_shards_gib": 2 * HUB_SHARD_BYTES / GIB}


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
