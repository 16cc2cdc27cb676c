"""GPT-OSS experts resident in MXFP4 (`dequantize_mxfp4: false`; finetune/models/mxfp4_experts.py, finetune/models/mxfp4_loading.py)
compute what the dequantize-at-load path computes, bit for bit: the tiny GPT-OSS written as the hub ships it, loaded
through the recipe's model loading both ways, trained a few steps with LoRA through peft and the grouped expert LoRA;
losses and every adapter gradient are equal (exactly: both paths run the same GEMMs on the same float32 weights).
A scale exponent off by one breaks that equality, so the comparison can see a wrong dequantizer.

The dequantizer is checked against benchmarks/mxfp4_checkpoints.py's reader, written from the format's definition,
and the Triton kernel (under TRITON_INTERPRET=1, skipped without triton) against the dequantizer.
"""

import dataclasses
import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from benchmarks import mxfp4_checkpoints
from finetune import families
from finetune.models import expert_lora, mxfp4_experts, mxfp4_loading

STEPS = 3


@pytest.fixture(scope="module")
def mxfp4_folder():
    return mxfp4_checkpoints.tiny_checkpoint()


@pytest.fixture(scope="module")
def many_shards(mxfp4_folder, tmp_path_factory):
    """The same checkpoint cut into shards of at most 64 kB: tensors of one experts module land in different files."""
    return mxfp4_checkpoints.resharded(mxfp4_folder, tmp_path_factory.mktemp("many-shards"), shard_bytes=64 << 10)


def random_packed(experts=3, outputs=40, groups=4, scales=(0, 255)):
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (experts, outputs, groups, 16), dtype=torch.uint8, generator=generator)
    return blocks, torch.randint(*scales, (experts, outputs, groups), dtype=torch.uint8, generator=generator)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[tensor.dtype])


def test_reference_dequantizer_gives_the_checkpoint_reader_s_weights_bit_for_bit():
    blocks, scales = random_packed()  # every scale byte, 0 (2**-127) to 254 (2**127)
    expected = mxfp4_checkpoints.dequantize(blocks, scales)
    assert torch.equal(bits(mxfp4_experts.dequantize(blocks, scales, torch.float32)), bits(expected))
    assert torch.equal(bits(mxfp4_experts.dequantize(blocks, scales, torch.bfloat16)),
                       bits(expected.to(torch.bfloat16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scale_byte_is_named_exactly_when_its_block_dequantizes_to_nan_or_infinity(dtype):
    """Every scale byte under a block holding every FP4 code, and under one holding only those up to 1.5 (253 and 254
    keep them finite): the check before loading (model_folder._scales_problem) names a byte exactly where the
    dequantizer gives NaN or infinite values, in float32 and bf16 alike."""
    code = torch.arange(16, dtype=torch.uint8)
    every_code = code | (code.flip(0) << 4)
    small_codes = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11] * 2, dtype=torch.uint8) * 0x11
    for block in (every_code, small_codes):
        for byte in range(256):
            blocks, scales = block.reshape(1, 1, 1, 16), torch.tensor([[[byte]]], dtype=torch.uint8)
            finite = bool(mxfp4_experts.dequantize(blocks, scales, dtype).isfinite().all())
            assert mxfp4_experts.nonfinite_scale(blocks, scales) == (None if finite else byte), (block, byte)


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """finetune/models/mxfp4_triton.py run by Triton's interpreter on CPU tensors (numpy underneath)."""
    pytest.importorskip("triton", reason="triton is not installed (.ci/run installs it for these tests)")
    from finetune.models import mxfp4_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield importlib.reload(mxfp4_triton)  # @triton.jit reads TRITON_INTERPRET when the module is imported
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(mxfp4_triton)


def assert_same_bits_or_both_nan(kernel: torch.Tensor, reference: torch.Tensor):
    """0 times the scale byte 255 (infinity) is NaN, whose bits are the device's: x86 and numpy give other NaNs than
    a GPU, for the reference and the interpreted kernel alike."""
    nan = reference.isnan()
    assert torch.equal(kernel.isnan(), nan)
    assert torch.equal(bits(kernel)[~nan], bits(reference)[~nan])


# numpy, under the interpreter, warns of the infinities and NaNs that the scale byte 255 gives, as the reference does
numpy_warns_of_scale_255 = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered in multiply")


@numpy_warns_of_scale_255
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_gives_the_reference_bits_for_every_code_under_every_scale_byte(interpreted_kernel, dtype):
    # Output row s has scale bytes s, s+64, s+128, s+192 (mod 256); each group of 16 bytes holds every code in its low
    # nibbles (even-indexed values) and, in another order, in its high nibbles. 256 x 128: a multiple of every tile.
    code = torch.arange(16, dtype=torch.uint8)
    blocks = (code | (code.flip(0) << 4)).expand(1, 256, 4, 16).contiguous()
    scales = ((torch.arange(256)[:, None] + 64 * torch.arange(4)) % 256).to(torch.uint8)[None]
    expected = mxfp4_experts.dequantize(blocks, scales, dtype)
    for config in interpreted_kernel.CONFIGS:  # the GPU's autotuning may pick any of them
        assert_same_bits_or_both_nan(interpreted_kernel.dequantize(blocks, scales, dtype, config), expected)


@numpy_warns_of_scale_255
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_gives_the_reference_bits_on_shapes_that_are_no_multiple_of_its_tiles(interpreted_kernel, dtype):
    # in = 160 and out = 72 (the 120B: in 2880, out 2880 or 5760), every scale byte
    blocks, scales = random_packed(experts=3, outputs=72, groups=5, scales=(0, 256))
    expected = mxfp4_experts.dequantize(blocks, scales, dtype)
    for config in interpreted_kernel.CONFIGS:
        assert_same_bits_or_both_nan(interpreted_kernel.dequantize(blocks, scales, dtype, config), expected)


@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "backward"])
def test_a_projection_dequantized_a_chunk_of_experts_at_a_time_gives_the_whole_projection_s_product(monkeypatch,
                                                                                                    transposed):
    blocks, scales = random_packed(experts=7, outputs=24, groups=2, scales=(110, 140))
    generator = torch.Generator().manual_seed(1)
    offsets = torch.tensor([3, 3, 9, 10, 10, 17, 20], dtype=torch.int32)  # experts 1 and 4 get no rows
    x = torch.randn(20, 24 if transposed else 64, generator=generator)
    monkeypatch.setattr(mxfp4_experts, "PREFETCH", mxfp4_experts.DequantizePrefetch())  # no requests seen before
    whole = mxfp4_experts.grouped_mm(x, blocks, scales, offsets, transposed)
    dequantized = []
    original = mxfp4_experts.dequantize_on_device
    monkeypatch.setattr(mxfp4_experts, "dequantize_on_device",
                        lambda *args: dequantized.append(args[0].shape[0]) or original(*args))
    per_expert = 24 * 64 * 4  # float32 values of one expert's weight
    monkeypatch.setattr(families, "DEQUANTIZED_CHUNK_BYTES", 3 * per_expert)
    chunked = mxfp4_experts.grouped_mm(x, blocks, scales, offsets, transposed)
    assert dequantized == [3, 3, 1]  # never more than three experts' weights at once
    assert torch.equal(bits(chunked), bits(whole))


def test_a_projection_in_chunks_holds_at_most_two_dequantized_chunks_with_the_next_one_prefetched(monkeypatch):
    """The second time a projection is asked for, each chunk was dequantized while the one before it was used:
    that one and the next, never the one before as well (the planner counts two)."""
    import weakref

    blocks, scales = random_packed(experts=6, outputs=24, groups=2, scales=(110, 140))
    offsets = torch.tensor([3, 5, 9, 10, 14, 20], dtype=torch.int32)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(families, "DEQUANTIZED_CHUNK_BYTES", 2 * 24 * 64 * 4)  # two experts a chunk: three chunks
    monkeypatch.setattr(mxfp4_experts, "PREFETCH", mxfp4_experts.DequantizePrefetch())
    dequantized, most_alive = [], []
    original = mxfp4_experts.dequantize_on_device

    def counted(*args):
        weight = original(*args)
        dequantized.append(weakref.ref(weight))
        most_alive.append(sum(ref() is not None for ref in dequantized))
        return weight

    monkeypatch.setattr(mxfp4_experts, "dequantize_on_device", counted)
    first, second = (mxfp4_experts.grouped_mm(x, blocks, scales, offsets) for _ in range(2))
    assert mxfp4_experts.PREFETCH.hits >= 2 and max(most_alive) == 2
    assert torch.equal(bits(second), bits(first))


@pytest.mark.parametrize("checkpoint", ["one shard", "many shards"])
def test_loading_keeps_the_stored_experts_packed_and_the_other_weights_as_stored(mxfp4_folder, many_shards,
                                                                                   checkpoint):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    folder = mxfp4_folder if checkpoint == "one shard" else many_shards
    assert (len(list(folder.glob("*.safetensors"))) > 1) == (checkpoint == "many shards")
    resident = mxfp4_loading.load(str(folder), "cpu", torch.float32).state_dict()
    dequantized = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                       quantization_config=Mxfp4Config(dequantize=True)).state_dict()
    expert_weights = mxfp4_checkpoints.stored_expert_weights(folder)
    for name, weight in expert_weights.items():
        blocks, scales = resident[f"{name}_blocks"], resident[f"{name}_scales"]
        assert blocks.dtype == scales.dtype == torch.uint8
        assert torch.equal(mxfp4_checkpoints.dequantize(blocks, scales), weight), name
        placeholder = resident[name]
        assert placeholder.shape == weight.shape and placeholder.untyped_storage().nbytes() == 4, name
    others = set(dequantized) - set(expert_weights)
    assert others and others <= set(resident)
    for name in others:
        assert torch.equal(resident[name], dequantized[name]), name


def training_run(folder, tmp_path, monkeypatch, dequantize: bool, targets: str, dequantizer=None):
    """The recipe's model loading, its LoRA config through peft, the grouped expert LoRA, then STEPS optimizer steps.
    Returns each step's loss and adapter gradients."""
    from peft import get_peft_model

    from finetune.checks import model_folder
    from finetune.checks import recipe as recipe_checks
    from finetune.run import arguments, model

    flags = ["--config", "recipes/gpt-oss-20b/lora.yaml", "--model_name_or_path", str(folder), "--output_dir",
             str(tmp_path / "out"), "--dequantize_mxfp4", str(dequantize).lower()]
    if targets == "attention only":
        flags += ["--lora_target_parameters", "none"]
    run = arguments.parse_args(flags)
    recipe_checks.check(run)
    with monkeypatch.context() as patch:
        if dequantizer is not None:
            patch.setattr(mxfp4_experts, "dequantize", dequantizer)
        loaded = model.load_model(run, model_folder.resolve_model_path(run))
        assert any(isinstance(module, mxfp4_experts.ResidentExperts) for module in loaded.modules()) != dequantize
        torch.manual_seed(0)
        peft_model = get_peft_model(loaded, model.lora_config(run))
        assert expert_lora.install(peft_model) == (2 if targets == "attention and experts" else 0)
        peft_model.train()
        optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
        ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(2))
        steps = []
        for _ in range(STEPS):
            loss = peft_model(input_ids=ids, labels=ids).loss
            loss.backward()
            steps.append((loss.item(), {name: parameter.grad.clone() for name, parameter in
                                        peft_model.named_parameters() if parameter.grad is not None}))
            optimizer.step()
            optimizer.zero_grad()
    return steps


def one_scale_off_by_one(blocks, scales, dtype):
    wrong = scales.clone()
    wrong[:, 0, 0] += 1  # every expert's first 32 weights of its first output doubled
    return mxfp4_checkpoints.dequantize(blocks, wrong).to(dtype)


@pytest.mark.parametrize("targets", ["attention and experts", "attention only"])
@pytest.mark.parametrize("dequantizer", [None, one_scale_off_by_one], ids=["reference", "one scale off by one"])
def test_training_on_resident_experts_gives_the_dequantized_losses_and_gradients(mxfp4_folder, tmp_path, monkeypatch,
                                                                                 targets, dequantizer):
    expected = training_run(mxfp4_folder, tmp_path, monkeypatch, True, targets)
    actual = training_run(mxfp4_folder, tmp_path, monkeypatch, False, targets, dequantizer)
    gradients = expected[-1][1]
    assert any("experts" in name for name in gradients) == (targets == "attention and experts")
    assert all(gradient.abs().max() > 0 for gradient in gradients.values())
    equal = all(loss == expected_loss and grads.keys() == expected_grads.keys()
                and all(torch.equal(grads[name], expected_grads[name]) for name in grads)
                for (loss, grads), (expected_loss, expected_grads) in zip(actual, expected, strict=True))
    assert equal == (dequantizer is None)


def test_saved_adapter_has_the_dequantized_model_s_keys_and_shapes(mxfp4_folder):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, Mxfp4Config

    config = LoraConfig(r=8, target_modules=["q_proj"], target_parameters=list(expert_lora.EXPERT_WEIGHTS))
    adapters = []
    for loaded in (mxfp4_loading.load(str(mxfp4_folder), "cpu", torch.float32),
                   AutoModelForCausalLM.from_pretrained(mxfp4_folder, dtype=torch.float32,
                                                        quantization_config=Mxfp4Config(dequantize=True))):
        state = get_peft_model_state_dict(get_peft_model(loaded, config))
        adapters.append({name: tuple(tensor.shape) for name, tensor in state.items()})
    assert adapters[0] == adapters[1] and any("experts" in name for name in adapters[0])


def test_peft_s_own_expert_lora_on_resident_experts_is_refused_not_silently_dropped(mxfp4_folder):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(mxfp4_loading.load(str(mxfp4_folder), "cpu", torch.float32),
                           LoraConfig(r=8, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"]))
    ids = torch.randint(0, 200, (1, 8))
    with pytest.raises(RuntimeError, match="only through finetune's grouped path"):
        model(input_ids=ids)
    with torch.no_grad(), model.disable_adapter():
        model(input_ids=ids)  # no expert adapter active: the resident experts' own forward


def test_resident_experts_trace_whole_under_torch_compile(mxfp4_folder):
    """fullgraph under aot_eager: the dequantizing GEMM is one opaque operator, forward and backward."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(mxfp4_loading.load(str(mxfp4_folder), "cpu", torch.float32),
                           LoraConfig(r=8, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"],
                                      init_lora_weights=False))
    assert expert_lora.install(model) == 2
    experts = model.base_model.model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(24, 64, generator=generator)
    indices = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(24)])
    weights = torch.softmax(torch.randn(24, 2, generator=generator), dim=-1)
    results = []
    torch._dynamo.reset()
    for module in (experts, torch.compile(experts, backend="aot_eager", fullgraph=True)):
        inputs = hidden.clone().requires_grad_(True)
        module(inputs, indices, weights).square().sum().backward()
        lora_a = experts.lora_A["default"].weight
        results.append((inputs.grad, lora_a.grad.clone()))
        lora_a.grad = None
    assert all(torch.allclose(actual, expected, rtol=1e-5, atol=1e-6)
               for actual, expected in zip(results[1], results[0], strict=True))


@pytest.mark.parametrize("strategy, processes, sentence", [
    ("ddp", 2, "keeps the experts resident in MXFP4 in one process only, and accelerate.yaml launches 2 processes "
               "(ddp); launch one process (`--num_processes 1` with accelerate_configs/ddp.yaml)"),
    # one process under ZeRO-3 is one process already: "launch one process" would change nothing
    ("zero3", 1, "keeps the experts resident in MXFP4 outside ZERO3's sharding, which accelerate.yaml asks for; launch "
                 "without that file (accelerate_configs/ddp.yaml with `--num_processes 1`)"),
])
def test_resident_experts_under_a_launch_they_cannot_run_in_are_refused_naming_the_flag_and_a_fix_that_works(
        strategy, processes, sentence, mxfp4_folder, tmp_path):
    from finetune.checks import recipe as recipe_checks
    from finetune.errors import UserError
    from finetune.run import arguments

    run = arguments.parse_args(["--config", "recipes/gpt-oss-20b/lora.yaml", "--model_name_or_path", str(mxfp4_folder),
                                "--output_dir", str(tmp_path / "out"), "--dequantize_mxfp4", "false"])
    run.launch = dataclasses.replace(run.launch, strategy=strategy, world_size=processes, config_file="accelerate.yaml")
    with pytest.raises(UserError) as refused:
        recipe_checks.check(run)
    assert str(refused.value).startswith("command line (--dequantize_mxfp4): `dequantize_mxfp4: false`"), refused.value
    assert sentence in str(refused.value), refused.value
    run.launch = dataclasses.replace(run.launch, strategy="single", world_size=1)  # the fix followed
    recipe_checks.check(run)


def test_a_trained_adapter_generates_the_same_with_its_experts_resident_as_dequantized(mxfp4_folder, tmp_path,
                                                                                       monkeypatch):
    """chat, generate and eval load a GPT-OSS adapter on its MXFP4 base with the experts resident on a GPU (120B's bf16
    experts fit no single GPU): the adapter's logits and greedy tokens are those of the dequantized base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

    from finetune.run import generation

    base = AutoModelForCausalLM.from_pretrained(mxfp4_folder, dtype=torch.float32,
                                                quantization_config=Mxfp4Config(dequantize=True))
    torch.manual_seed(0)
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"],
                                              target_parameters=list(expert_lora.EXPERT_WEIGHTS), init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(mxfp4_folder).save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(3))
    outputs = {}
    for resident in (False, True):
        monkeypatch.setattr(generation, "keeps_experts_in_mxfp4", lambda device, resident=resident: resident)
        model, _ = generation.load_trained(str(tmp_path / "adapter"), str(mxfp4_folder), "cpu")
        assert any(isinstance(module, mxfp4_experts.ResidentExperts) for module in model.modules()) == resident
        with torch.no_grad():
            outputs[resident] = (model(input_ids=ids).logits,
                                 model.generate(input_ids=ids, max_new_tokens=6, do_sample=False))
    assert torch.allclose(outputs[True][0], outputs[False][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(outputs[True][1], outputs[False][1])


def packed_rows(vocab: int) -> list[dict]:
    """Rows as TRL's BFD packing leaves them: several conversations each (`seq_lengths`), the prompt tokens' labels
    -100 (assistant_only_loss), of different lengths."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for documents in ([9, 14], [20], [5, 7, 11], [16, 6]):
        input_ids, labels = [], []
        for length in documents:
            ids = torch.randint(1, vocab, (length,), generator=generator).tolist()
            prompt = length // 3
            input_ids += ids
            labels += [-100] * prompt + ids[prompt:]
        rows.append({"input_ids": input_ids, "labels": labels, "seq_lengths": documents})
    return rows


def micro_batch_gradients(model, rows: list[dict], micro_batch: int) -> tuple[float, dict]:
    """SFTTrainer's step over `rows`, `micro_batch` rows at a time: its padding-free collator flattens each
    micro-batch into one sequence, its fused LM head scores the labelled tokens, each micro-batch's summed loss is
    divided by the step's labelled tokens (num_items_in_batch) and the gradients accumulate."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    batches = [collate(rows[start:start + micro_batch]) for start in range(0, len(rows), micro_batch)]
    num_items_in_batch = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in batches)
    model.zero_grad()
    total = 0.0
    for batch in batches:
        outputs = model(**batch, fused_lm_head=True)
        loss = -outputs.log_probs.sum() / num_items_in_batch
        loss.backward()
        total += loss.item()
    return total, {name: parameter.grad.clone() for name, parameter in model.named_parameters()
                   if parameter.grad is not None}


def test_a_micro_batch_of_several_packed_rows_gives_the_loss_and_gradients_of_the_rows_one_at_a_time(
        mxfp4_folder, tmp_path, monkeypatch):
    """The 120B recipe's path on the tiny GPT-OSS, experts resident in MXFP4 and dequantized one expert at a time,
    TRL's fused LM head in tiles of 16 tokens x 64 vocabulary columns: 4 packed rows in one micro-batch, then in 4
    micro-batches of one row. Raising per_device_train_batch_size (and lowering gradient_accumulation_steps to keep
    the rows a step) changes the speed only: float32 on the CPU, equal within rounding (relative 1e-5; measured: the
    loss equal, the gradients within 6e-7 of their largest value). Not the load-balancing loss, which TRL adds for
    GPT-OSS (router_aux_loss_coef 0.9 from its config): a statistic of each micro-batch's tokens, not a sum over them,
    so it is left out here as `router_aux_loss_coef: 0` leaves it out (the tiny config's output_router_logits)."""
    from peft import get_peft_model
    from trl.kernels import chunked_logprob
    from trl.trainer import utils as trl_utils
    from trl.trainer.utils import add_fused_lm_head

    from finetune import patches
    from finetune.checks import model_folder
    from finetune.run import arguments, model

    run = arguments.parse_args(["--config", "recipes/gpt-oss-120b/lora.yaml", "--model_name_or_path",
                                str(mxfp4_folder), "--output_dir", str(tmp_path / "out")])
    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", 16)
    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 64)
    loaded = model.load_model(run, model_folder.resolve_model_path(run))
    assert not loaded.config.output_router_logits
    experts = next(module for module in loaded.modules() if isinstance(module, mxfp4_experts.ResidentExperts))
    monkeypatch.setattr(families, "DEQUANTIZED_CHUNK_BYTES", experts.gate_up_proj[0].numel() * 4)
    torch.manual_seed(0)
    peft_model = get_peft_model(loaded, model.lora_config(run))
    assert expert_lora.install(peft_model) == 2
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which leaves A without a gradient to compare
            torch.nn.init.normal_(parameter, std=0.05)
    add_fused_lm_head(peft_model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer does
    patches.keep_packed_documents_apart(peft_model)  # as build_trainer does
    peft_model.train()
    rows = packed_rows(loaded.config.vocab_size)
    assert len({len(row["input_ids"]) for row in rows}) > 1
    one_at_a_time = micro_batch_gradients(peft_model, rows, micro_batch=1)
    all_at_once = micro_batch_gradients(peft_model, rows, micro_batch=len(rows))
    assert all_at_once[0] == pytest.approx(one_at_a_time[0], rel=1e-5)
    gradients, expected = all_at_once[1], one_at_a_time[1]
    assert gradients.keys() == expected.keys() and any("experts" in name for name in gradients)
    assert all(gradient.abs().max() > 0 for gradient in expected.values())
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected[name], rtol=1e-5, atol=1e-5 * expected[name].abs().max(),
                                   msg=name)


def test_the_fused_gemm_runs_only_on_a_gpu_with_bf16_tensor_cores_and_triton(monkeypatch):
    """Elsewhere the chunked path computes: a CPU tensor, a GPU below compute capability 8.0 (no bf16 tensor cores),
    a GPU without triton."""
    assert mxfp4_experts._fused_gemm_kernel(torch.zeros(4, 64)) is None
    on_gpu = SimpleNamespace(is_cuda=True, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=7, minor=5))
    assert mxfp4_experts._fused_gemm_kernel(on_gpu) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=9, minor=0))
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "finetune.models.mxfp4_grouped_gemm", raising=False)
    mxfp4_experts._triton_kernels.cache_clear()
    try:
        assert mxfp4_experts._fused_gemm_kernel(on_gpu) is None
    finally:
        mxfp4_experts._triton_kernels.cache_clear()  # what triton there is, found again by the next caller


def test_resident_experts_loaded_on_a_gpu_without_triton_say_so_with_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(mxfp4_experts, "without_triton", lambda: True)
    mxfp4_loading.say_without_triton(torch.device("cpu"))
    assert capsys.readouterr().out == ""  # a CPU never uses the kernels
    mxfp4_loading.say_without_triton(torch.device("cuda", 0))
    said = capsys.readouterr().out
    assert "triton is not installed" in said and "`pip install triton` fixes it" in said
    monkeypatch.setattr(mxfp4_experts, "without_triton", lambda: False)
    mxfp4_loading.say_without_triton(torch.device("cuda", 0))
    assert capsys.readouterr().out == ""


def adapted_with_a_prefetch_of_its_own(folder, monkeypatch):
    """The tiny GPT-OSS resident on the CPU with LoRA on q_proj and both expert weights through the grouped path, and
    a DequantizePrefetch that has seen no request, in the operator's place."""
    from peft import LoraConfig, get_peft_model

    prefetch = mxfp4_experts.DequantizePrefetch()
    monkeypatch.setattr(mxfp4_experts, "PREFETCH", prefetch)
    model = get_peft_model(mxfp4_loading.load(str(folder), "cpu", torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False,
                                      target_parameters=list(expert_lora.EXPERT_WEIGHTS)))
    assert expert_lora.install(model) == model.config.num_hidden_layers
    return model, prefetch


def adapter_gradients(model) -> dict:
    """The gradients of the last backward, taken and cleared."""
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()
                 if parameter.grad is not None}
    model.zero_grad()
    return gradients


@pytest.mark.parametrize("compiled, checkpointing", [(False, True), (True, True), (False, False)],
                         ids=["eager", "layers compiled", "no checkpointing"])
def test_once_a_micro_batch_has_shown_the_order_each_chunk_of_experts_is_dequantized_before_it_is_asked_for(
        mxfp4_folder, monkeypatch, compiled, checkpointing):
    """With checkpointing a micro-batch asks for each layer's gate_up then down in the forward, again in the
    recomputation, then down and gate_up transposed for the input gradients: 6 requests a layer, of which the last two
    reuse the recomputation's weights (whole projections: the tiny model's experts fit one chunk). The first
    micro-batch shows the order (each chunk dequantized where it is asked for); in the second every chunk but the first
    was dequantized ahead, while the one before it ran (DequantizePrefetch), and the gradients are the same bits.
    Without checkpointing, 4 requests a layer, none reused (nothing kept between the forward and the backward)."""
    model, prefetch = adapted_with_a_prefetch_of_its_own(mxfp4_folder, monkeypatch)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if compiled:  # as a compiled run does: each checkpointed layer runs checkpoint(compiled(layer))
        from torch._dynamo.utils import counters

        from finetune.models.compilation import CompileInsideCheckpoints

        torch._dynamo.reset()
        counters.clear()  # an earlier test's compiles in this process
        CompileInsideCheckpoints("aot_eager", None).on_train_begin(None, None, None, model=model)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(5))
    gradients = []
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        gradients.append(adapter_gradients(model))
    if compiled:
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    dequantized = 4 * model.config.num_hidden_layers  # a micro-batch's forward and recomputation, or backward
    reused = dequantized if checkpointing else 0
    assert (prefetch.misses, prefetch.hits, prefetch.reused) == (dequantized + 1, dequantized - 1, reused)
    assert any("experts" in name for name in gradients[0])
    assert all(torch.equal(gradients[1][name], gradient) for name, gradient in gradients[0].items())


def test_kept_weights_never_outlive_their_layer_when_the_backward_asks_through_other_tensors(mxfp4_folder,
                                                                                             monkeypatch):
    """Saved tensors that come back as copies (TRL's activation offloading moves plain buffers to the CPU and back):
    the backward's transposed requests name other tensors than the recomputation's, so nothing kept is reused, and
    what a layer kept is dropped when the next layer's recomputation begins, not held for every layer; the gradients
    are those of the run without copies. After `release` nothing is held or remembered."""
    model, prefetch = adapted_with_a_prefetch_of_its_own(mxfp4_folder, monkeypatch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.train()
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(6))
    most_kept, gradients = [], []

    def most_kept_so_far(tensor):
        most_kept.append(len(prefetch._kept))
        return tensor

    for copies in (False, True):
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda tensor, copies=copies: tensor.clone() if copies and tensor.dtype == torch.uint8 else tensor,
            most_kept_so_far)
        with hooks:
            model(input_ids=ids, labels=ids).loss.backward()
        gradients.append(adapter_gradients(model))
        if copies:
            assert max(most_kept) <= 2  # one layer's gate_up and down
        else:
            assert prefetch.reused == 2 * model.config.num_hidden_layers
        most_kept.clear()
    assert prefetch.reused == 2 * model.config.num_hidden_layers  # none in the run with copies
    assert all(torch.equal(gradients[1][name], gradient) for name, gradient in gradients[0].items())
    prefetch.release()
    assert prefetch._pending is None and not prefetch._kept and not prefetch._followers


def test_under_activation_offloading_compiled_layers_offload_only_their_inputs_and_reuse_the_recomputed_weights(
        mxfp4_folder, monkeypatch):
    """recipes/gpt-oss-20b/lora_mxfp4.yaml: checkpointing, compiled layers and TRL's activation offloading on resident
    experts. Only the layer inputs go to the CPU, in the forward; the recomputation keeps its tensors where they are,
    so the transposed products of the backward find the recomputation's weights (two passes over the experts a
    micro-batch, not three), and the gradients are those of the run without offloading."""
    from finetune.models.compilation import CompileInsideCheckpoints
    from tests.helpers import loss_and_backward

    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(7))
    runs = []
    for offloading in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)  # the same random adapters in both runs
        model, prefetch = adapted_with_a_prefetch_of_its_own(mxfp4_folder, monkeypatch)
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
        model.train()
        CompileInsideCheckpoints("aot_eager", None, offloading=offloading).on_train_begin(None, None, None, model=model)
        loss, offloaded = loss_and_backward(model, ids, monkeypatch, offloading)
        runs.append((loss, adapter_gradients(model), prefetch.reused, offloaded))
    torch._dynamo.reset()
    (loss, gradients, reused, _), (offloaded_loss, offloaded_gradients, offloaded_reused, offloaded) = runs
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    assert offloaded_reused == reused == 2 * layers
    assert offloaded.count(("forward", (*ids.shape, hidden))) >= layers, offloaded
    assert all(when == "forward" for when, _ in offloaded), "the recomputed layers were offloaded too"
    packed = {tuple(buffer.shape) for buffer in model.buffers() if buffer.dtype == torch.uint8}
    assert packed and not packed & {shape for _, shape in offloaded}, "the experts' MXFP4 bytes went to the CPU"
    assert torch.equal(offloaded_loss, loss)
    assert any("experts" in name for name in gradients)
    assert all(torch.equal(offloaded_gradients[name], gradient) for name, gradient in gradients.items())
