"""`finetune merge` of a LoRA adapter into a GPT-OSS MXFP4 base, shard by shard (finetune/run/merging.py): the
merged model is the one peft's merge_and_unload gives on the base loaded dequantized in memory, bit for bit, in the
hub's layout from_pretrained loads, while host memory holds about one input shard and its output, not the model.
"""

import json

import pytest
import torch
from safetensors import safe_open

from benchmarks import merge_memory, mxfp4_checkpoints
from finetune import cli
from finetune.models import expert_lora, mxfp4_experts
from finetune.run import merging


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    """The tiny MXFP4 GPT-OSS in shards of at most 16 kB: an expert weight's blocks and scales in two files, and an
    experts module's tensors in two."""
    return mxfp4_checkpoints.resharded(mxfp4_checkpoints.tiny_checkpoint(), tmp_path_factory.mktemp("small-shards"),
                                       shard_bytes=16 << 10)


def dequantized(folder):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(folder, dtype="auto", quantization_config=Mxfp4Config(dequantize=True))


@pytest.fixture(scope="module")
def adapter(small_shards, tmp_path_factory):
    """LoRA r3 (the 120B recipe's rank) on every attention projection and both expert weights, with random B so
    that every merged weight moves; saved as peft saves it, with the tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    config = LoraConfig(r=3, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=list(expert_lora.EXPERT_WEIGHTS), init_lora_weights=False)
    folder = tmp_path_factory.mktemp("adapter")
    get_peft_model(dequantized(small_shards), config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(mxfp4_checkpoints.tiny_checkpoint()).save_pretrained(folder)
    return folder


def shard_of(folder) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def scale_dropped(blocks, scales, dtype, dequantize=mxfp4_experts.dequantize):
    return dequantize(blocks, torch.full_like(scales, 127), dtype)  # every scale read as 2**0


@pytest.mark.parametrize("dequantizer", [None, scale_dropped], ids=["reference", "scale dropped"])
def test_streamed_merge_of_an_mxfp4_base_is_the_in_memory_merge_bit_for_bit(small_shards, adapter, tmp_path,
                                                                          monkeypatch, dequantizer, capfd):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    stored = shard_of(small_shards)
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"] != stored[
        "model.layers.0.mlp.experts.gate_up_proj_scales"]
    assert stored["model.layers.0.mlp.experts.down_proj_blocks"] != stored[
        "model.layers.0.mlp.experts.gate_up_proj_blocks"]
    in_memory = PeftModel.from_pretrained(dequantized(small_shards), adapter).merge_and_unload()
    in_memory.save_pretrained(tmp_path / "in-memory")
    expected = in_memory.state_dict()
    monkeypatch.setattr(merging, "EXPERTS_PER_CHUNK", 3)  # the tiny model's 4 experts in chunks of 3 and 1
    if dequantizer is not None:
        monkeypatch.setattr(mxfp4_experts, "dequantize", dequantizer)
    merged = tmp_path / "merged"
    command = ["merge", str(adapter), str(merged), "--base_model", str(small_shards)]
    assert cli.main(command) == 0, capfd.readouterr().err
    assert len(set(shard_of(merged).values())) > 1
    for name in ("config.json", "generation_config.json"):
        assert json.loads((merged / name).read_text()) == json.loads((tmp_path / "in-memory" / name).read_text()), name
    loaded = AutoModelForCausalLM.from_pretrained(merged).state_dict()  # no quantization_config: loads as it is
    assert loaded.keys() == expected.keys()
    moved = {name for name, tensor in expected.items() if not torch.equal(tensor, dequantized(small_shards)
                                                                          .state_dict()[name])}
    assert any("experts" in name for name in moved) and any("q_proj" in name for name in moved)
    different = {name for name, tensor in expected.items()
                 if loaded[name].dtype != tensor.dtype or not torch.equal(loaded[name].view(torch.int16),
                                                                          tensor.view(torch.int16))}
    expert_weights = {f"model.layers.{layer}.mlp.experts.{weight}" for layer in (0, 1)
                      for weight in expert_lora.EXPERT_WEIGHTS}
    assert different == (set() if dequantizer is None else expert_weights)


def merged_size(folder) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


@pytest.mark.skipif(not merge_memory.measurable(), reason="needs Linux's /proc/self/clear_refs and glibc's mallopt")
def test_streamed_merge_holds_shards_not_the_model_in_host_memory(tmp_path):
    """The peak host memory of a merge 4x as deep (12 layers instead of 3, stored in MXFP4 shards of 2 MiB, 6.6 MB a layer merged)
    grows by less than half of what the model grows by (57 MiB: 7 MiB measured, most of it the adapter peft reads
    whole); holding every merged tensor until the end grows it by 65 MiB."""
    merge_memory.serve_large_allocations_from_mmap()
    peaks, sizes = {}, {}
    for layers in (3, 3, 12):  # the first merge imports and initialises what later ones reuse
        base, adapter = merge_memory.write_base_and_adapter(tmp_path / f"{layers}-{len(peaks)}", layers, hidden=256,
                                                            experts=16, shard_bytes=2 << 20)
        output = base.parent / "merged"
        peaks[layers] = merge_memory.merge_peak(base, adapter, output, streamed=True)["peak_above_start_bytes"]
        sizes[layers] = merged_size(output)
    assert sizes[12] - sizes[3] > 50 << 20
    assert peaks[12] - peaks[3] < (sizes[12] - sizes[3]) / 2, (peaks, sizes)
