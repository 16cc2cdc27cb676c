"""`finetune merge` of a LoRA adapter into a GPT-OSS MXFP4 base, shard by shard (finetune/run/merging.py): the
merged model is the one peft's merge_and_unload gives on the base loaded dequantized in memory, bit for bit, in the
hub's layout from_pretrained loads, while host memory holds a chunk of experts, not a shard nor the model.
"""

import json

import pytest
import torch
from safetensors import safe_open

from benchmarks import merge_memory, mxfp4_checkpoints
from finetune import cli
from finetune.checks import model_folder
from finetune.models import expert_lora, mxfp4_experts
from finetune.run import merging, shard_writing


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
    """LoRA r3 (a rank the grouped GEMMs pad, as the 120B recipe's r4) on every attention projection and both expert weights, with random B so
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
    model_folder.check_model(str(merged), "OUTPUT_DIR")  # its bf16 experts pass the weights' check
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


def test_streamed_merge_writes_the_files_and_index_save_pretrained_writes_of_the_in_memory_merge(
        small_shards, adapter, tmp_path, capfd):
    """Byte for byte, with shards as large as the largest stored one: so from_pretrained loads them as it loads
    save_pretrained's."""
    from peft import PeftModel

    largest_stored_shard = max(path.stat().st_size for path in small_shards.glob("*.safetensors"))
    in_memory = PeftModel.from_pretrained(dequantized(small_shards), adapter).merge_and_unload()
    in_memory.save_pretrained(tmp_path / "saved", max_shard_size=largest_stored_shard)
    merged = tmp_path / "merged"
    assert cli.main(["merge", str(adapter), str(merged), "--base_model", str(small_shards)]) == 0, capfd.readouterr().err
    saved = sorted(path.name for path in (tmp_path / "saved").glob("*.safetensors"))
    assert len(saved) > 1 and sorted(path.name for path in merged.glob("*.safetensors")) == saved
    for name in [*saved, "model.safetensors.index.json"]:
        assert (merged / name).read_bytes() == (tmp_path / "saved" / name).read_bytes(), name


def test_a_safetensors_file_written_a_piece_at_a_time_is_the_one_safetensors_writes(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {"rows": torch.randn(5, 3).to(torch.bfloat16), "matrix": torch.randn(7, 2),
               "codes": torch.arange(5, dtype=torch.uint8), "scalar": torch.tensor(2.0)}
    save_file(tensors, str(tmp_path / "whole.safetensors"), metadata={"format": "pt"})
    pieces = shard_writing.SafetensorsFile(tmp_path / "pieces.safetensors",
                                           {name: tensor.to("meta") for name, tensor in tensors.items()})
    for name, rows in [("codes", slice(0, 2)), ("rows", slice(0, 4)), ("scalar", ...), ("matrix", slice(None)),
                       ("codes", slice(2, None)), ("rows", slice(4, None))]:
        assert not pieces.complete()
        pieces.write(name, tensors[name][rows])
    pieces.close()
    assert (tmp_path / "pieces.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    with safe_open(str(tmp_path / "pieces.safetensors"), "pt") as read_back:
        assert all(torch.equal(read_back.get_tensor(name), tensor) for name, tensor in tensors.items())


@pytest.mark.skipif(not merge_memory.measurable(), reason="needs Linux's /proc/self/clear_refs and glibc's mallopt")
def test_streamed_merge_holds_less_than_two_stored_shards_in_host_memory(small_shards, adapter, tmp_path,
                                                                          monkeypatch, capfd):
    """A layer of 128 experts of width 384 (113 MB merged, 28 MB stored) in shards of 24 MiB, merged 2 experts at a
    time: the peak host memory above the process's resident size before the merge stays under two stored shards,
    where holding one merged expert weight (75 MB), let alone the layer, would not."""
    merge_memory.serve_large_allocations_from_mmap()
    command = ["merge", str(adapter), str(tmp_path / "warm-up"), "--base_model", str(small_shards)]
    assert cli.main(command) == 0, capfd.readouterr().err  # what the first merge imports and initialises
    stored_shard_bytes = 24 << 20
    config = merge_memory.scaled_config(layers=1, hidden=384, experts=128)
    base, adapter = merge_memory.write_base_and_adapter(tmp_path, config, stored_shard_bytes, rank=3)
    monkeypatch.setattr(merging, "EXPERTS_PER_CHUNK", 2)
    merged = tmp_path / "merged"
    peak = merge_memory.merge_peak(base, adapter, merged, streamed=True)["peak_above_start_bytes"]
    assert max(path.stat().st_size for path in base.glob("*.safetensors")) <= stored_shard_bytes
    assert max(path.stat().st_size for path in merged.glob("*.safetensors")) > 2 * stored_shard_bytes
    assert peak < 2 * stored_shard_bytes, peak




@pytest.mark.parametrize("damaged", ["adapter", "base"])
def test_the_streamed_merge_refuses_nan_in_the_adapter_or_in_a_base_weight_before_writing(damaged, small_shards,
                                                                                          adapter, tmp_path, capfd):
    """The streamed merge never loads the model, so the check after loading (check_finite) never saw it: a lora_A or
    an attention weight of the base holding NaN was merged into the model written, exit 0. The files are read before
    merging, and refused in check_finite's words."""
    import shutil

    from tests.test_bad_model_folders import with_tensors

    adapter_copy, base = shutil.copytree(adapter, tmp_path / "adapter"), shutil.copytree(small_shards, tmp_path / "base")
    if damaged == "adapter":
        weights = adapter_copy / "adapter_model.safetensors"
        tensor, fix = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight", "re-save the adapter"
    else:
        tensor, fix = "model.layers.1.self_attn.q_proj.weight", "re-download the model"
        weights = base / shard_of(base)[tensor]
    with_tensors(lambda tensors: tensors[tensor].view(-1)[2].fill_(float("nan")), weights.name)(weights.parent)
    capfd.readouterr()
    assert cli.main(["merge", str(adapter_copy), str(tmp_path / "merged"), "--base_model", str(base)]) == 2
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: {weights}: {tensor} holds NaN or infinite values, so every output it touches would "
                           f"be NaN") and fix in line, line
    assert not (tmp_path / "merged").exists()
