"""The fused MXFP4 grouped GEMM (finetune/models/mxfp4_grouped_gemm.py) under Triton's interpreter on CPU tensors,
skipped without triton (.ci/run installs it and runs these tests), against the chunked path it would replace
(`mxfp4_experts._chunked_grouped_mm`), and where training takes it.

Both accumulate in float32 and round to bf16, in different orders: the kernel's output is compared with the float32
product rounded to bf16, within one bf16 ulp of the larger of the two plus twice float32's worst-case error of a sum
of `reduced` products (reduced * 2**-24 * sum |x·w|). Under the interpreter the kernel's rounding to bf16 truncates
(the GPU rounds to nearest), which that one ulp covers; a wrong scale or expert boundary is off by far more.
"""

import importlib
import json
import sys

import pytest
import torch

from finetune import families
from finetune.models import expert_lora, mxfp4_experts

EXPERTS, OUTPUTS, GROUPS = 5, 96, 5  # in = 160 and out = 96: no multiple of the tiles along either
# Experts 0, 2 and 4 get no rows; experts 1 and 3 more than one 64-row tile; 3 rows after the last expert's
OFFSETS = (0, 70, 70, 141, 141)
ROWS = 144


@pytest.fixture(scope="module")
def interpreted_gemm():
    """finetune/models/mxfp4_grouped_gemm.py and the decode it takes from mxfp4_triton, run by Triton's interpreter."""
    pytest.importorskip("triton", reason="triton is not installed (.ci/run installs it for these tests)")
    from finetune.models import mxfp4_grouped_gemm, mxfp4_triton

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        importlib.reload(mxfp4_triton)  # @triton.jit reads TRITON_INTERPRET when the module is imported
        yield importlib.reload(mxfp4_grouped_gemm)
    importlib.reload(mxfp4_triton)
    importlib.reload(mxfp4_grouped_gemm)


def packed(scale_bytes=(116, 126)):
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (EXPERTS, OUTPUTS, GROUPS, 16), dtype=torch.uint8, generator=generator)
    return blocks, torch.randint(*scale_bytes, (EXPERTS, OUTPUTS, GROUPS), dtype=torch.uint8, generator=generator)


def activations(transposed: bool) -> torch.Tensor:
    width = OUTPUTS if transposed else GROUPS * 32
    return torch.randn(ROWS, width, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def assert_within_accumulation_order(kernel: torch.Tensor, x: torch.Tensor, blocks, scales, offsets, transposed):
    """The float32 reference product of the chunked path, rounded to bf16, on the rows the experts own."""
    routed = int(offsets[-1])
    reference = mxfp4_experts._chunked_grouped_mm(x.float(), blocks, scales, offsets, transposed)[:routed]
    weights = mxfp4_experts.dequantize(blocks, scales, torch.float32).abs()
    magnitudes = expert_lora.grouped_mm(x.float().abs(), weights.transpose(-2, -1) if transposed else weights,
                                        offsets)[:routed]
    rounded = reference.to(torch.bfloat16).float()
    ulp = torch.ldexp(torch.ones_like(rounded), torch.frexp(torch.maximum(rounded.abs(), kernel[:routed].float().abs()))
                      .exponent - 8)
    tolerance = ulp + 2 * x.shape[1] * 2.0**-24 * magnitudes
    difference = (kernel[:routed].float() - rounded).abs()
    assert (difference <= tolerance).all(), f"{(difference > tolerance).sum()} outputs off by up to {difference.max()}"


@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "input-gradient"])
def test_fused_gemm_gives_the_chunked_product_for_every_tile_configuration(interpreted_gemm, transposed):
    blocks, scales = packed()
    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
    x = activations(transposed)
    for config in interpreted_gemm.CONFIGS:  # the GPU's autotuning may pick any of them
        kernel = interpreted_gemm.mxfp4_grouped_matmul(x, blocks, scales, offsets, transposed, config)
        assert kernel.dtype == torch.bfloat16
        assert kernel.shape == (ROWS, GROUPS * 32 if transposed else OUTPUTS)
        assert_within_accumulation_order(kernel, x, blocks, scales, offsets, transposed)
        assert not kernel[OFFSETS[-1]:].any()  # rows no expert owns: zeros, as the chunked path leaves them


def test_fused_gemm_takes_every_scale_exponent_as_the_dequantizer_does(interpreted_gemm):
    # Scales from 2**-27 to 2**27: a product off by a power of two anywhere in the range fails
    blocks, scales = packed(scale_bytes=(100, 155))
    offsets = torch.tensor((20, 40, 60, 100, ROWS), dtype=torch.int32)
    for transposed in (False, True):
        x = activations(transposed)
        kernel = interpreted_gemm.mxfp4_grouped_matmul(x, blocks, scales, offsets, transposed)
        assert_within_accumulation_order(kernel, x, blocks, scales, offsets, transposed)


def test_benchmark_times_the_fused_gemm_against_the_chunked_path(interpreted_gemm, tmp_path, monkeypatch):
    """benchmarks/mxfp4_resident_check.py --fused_gemm on the tiny GPT-OSS: its code, not its timings."""
    from benchmarks import mxfp4_checkpoints, mxfp4_resident_check

    folder = mxfp4_checkpoints.tiny_checkpoint()
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["mxfp4_resident_check.py", "--fused_gemm", "--architecture", str(folder),
                                      "--gemm_tokens", "24"])
    mxfp4_resident_check.main()
    result = json.loads((tmp_path / "mxfp4_fused_gemm.json").read_text())
    projections = result["fused_gemm"][str(folder)]
    for name in ("gate_up_proj", "down_proj"):
        assert sorted(projections[name]) == ["24 tokens, forward", "24 tokens, transposed", "dequantize_ms"]
        for case in (projections[name][f"24 tokens, {form}"] for form in ("forward", "transposed")):
            assert case["fused_ms"] > 0 and case["chunked_ms"] > 0
            assert case["max_abs_diff"] <= case["max_abs_reference"] * 2**-7  # one bf16 ulp of the largest output


def test_benchmark_times_the_prefetched_dequantization_against_dequantizing_where_asked(interpreted_gemm, tmp_path,
                                                                                        monkeypatch):
    """benchmarks/mxfp4_resident_check.py --prefetch on the tiny GPT-OSS: its code, not its timings. Over the warm-up,
    5 timed passes and the compared one, 4 requests a layer a pass (6 with checkpointing, 2 of them reused): the first
    pass and the next one's first request dequantized where asked, the rest ahead; kept only, every request but the
    reused ones dequantized where asked; the same bits every way."""
    from benchmarks import mxfp4_checkpoints, mxfp4_resident_check

    folder = mxfp4_checkpoints.tiny_checkpoint()
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["mxfp4_resident_check.py", "--prefetch", "--architecture", str(folder),
                                      "--tokens", "24", "--layers", "3"])
    mxfp4_resident_check.main()
    result = json.loads((tmp_path / "mxfp4_prefetch.json").read_text())
    for case, asked, reused in (("no checkpointing", 4, 0), ("checkpointing", 4, 2)):
        timings = result[case]
        passes, layers = 7, 3
        before = timings["resident, dequantized where asked"]
        after = timings["resident, prefetched and kept"]
        assert before["misses"] == passes * layers * (asked + reused) and before["hits"] == before["reused"] == 0
        assert (after["misses"], after["hits"], after["reused"]) == (
            layers * asked + 1, (passes - 1) * layers * asked - 1, passes * layers * reused)
        kept = timings["resident, kept only"]
        assert (kept["misses"], kept["hits"], kept["reused"]) == (passes * layers * asked, 0, passes * layers * reused)
        assert timings["max_abs_diff_prefetched"] == timings["max_abs_diff_kept"] == 0.0 and all(
            timings[label]["fwd_bwd_ms"] > 0 for label in ("dense", "resident, dequantized where asked"))


def test_training_takes_the_fused_gemm_where_the_experts_get_at_most_256_rows_each(interpreted_gemm, monkeypatch):
    """The operator GroupedLoraMatmul calls for resident experts, forward and input gradient: the fused kernel up to
    families.FUSED_GEMM_MAX_ROWS_PER_EXPERT rows an expert on average, the chunked path above (Triton's interpreter stands in
    for the GPU's kernel)."""
    taken = []
    monkeypatch.setattr(mxfp4_experts, "_fused_gemm_kernel", lambda x: taken.append(x.shape[0]) or interpreted_gemm)
    blocks, scales = packed()
    at_the_limit = families.FUSED_GEMM_MAX_ROWS_PER_EXPERT * EXPERTS
    generator = torch.Generator().manual_seed(2)
    for transposed in (False, True):
        x = torch.randn(at_the_limit, OUTPUTS if transposed else GROUPS * 32, generator=generator).to(torch.bfloat16)
        offsets = torch.tensor((0, 700, 700, at_the_limit - 5, at_the_limit - 5), dtype=torch.int32)
        product = mxfp4_experts.grouped_mm(x, blocks, scales, offsets, transposed)
        assert taken.pop() == at_the_limit
        assert_within_accumulation_order(product, x, blocks, scales, offsets, transposed)
        assert not product[at_the_limit - 5:].any()

        mxfp4_experts.grouped_mm(torch.cat([x, x[:1]]), blocks, scales, offsets, transposed)
        assert not taken  # one row more: the chunked path
