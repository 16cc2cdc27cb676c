"""GPT-OSS experts resident in MXFP4 (finetune/models/mxfp4_experts.py) on one GPU, real shapes, random weights, no network,
under 3 minutes (a CPU with TRITON_INTERPRET=1 and --architecture TINY_MODEL_FOLDER runs the code, not the check):

    python benchmarks/mxfp4_resident_check.py [--architecture gpt-oss-20b|gpt-oss-120b] [--tokens 8192] [--kernel_variants]
    python benchmarks/mxfp4_resident_check.py --fused_gemm [--architecture ...] [--gemm_tokens 2048 4096 8192 16384]
    python benchmarks/mxfp4_resident_check.py --prefetch [--architecture ...] [--tokens 8192] [--layers 4]

The Triton dequantizer bit-equal to the reference (a layer's blocks; every scale byte), its time per layer and the
configuration its autotuning picked for each projection shape; one layer's experts with LoRA, forward + backward, dense
bf16 against resident (time, peak memory, max abs differences: 0 expected where the chunked path runs, bf16 rounding
where the fused GEMM takes the experts, at most 256 rows each: 120B at 8,192 tokens); a 2-layer checkpoint loaded
resident (seconds, peak memory). With --kernel_variants, each configuration the autotuning chooses from and the previous kernel
(benchmarks/mxfp4_dequantize_previous.py), timed one by one on the layer. One JSON line, also in
$OUT/mxfp4_resident_check.json.

With --fused_gemm, only the frozen expert GEMM, for GPT-OSS-120B and -20B (or --architecture): the chunked path
training uses (`mxfp4_experts._chunked_grouped_mm`: dequantize a chunk of experts, then torch._grouped_mm) against the
fused kernel of finetune/models/mxfp4_grouped_gemm.py, on each projection, forward and transposed (the input
gradient), for each of --gemm_tokens routed uniformly at random to the model's top-k of its experts: milliseconds,
effective GB/s (MXFP4 weights, x and the output, each moved once) and TFLOP/s of each, max abs difference; and the
time of dequantizing each whole projection, the share of the chunked path that the fused kernel saves. One JSON line,
also in $OUT/mxfp4_fused_gemm.json.

With --prefetch, --layers layers of resident experts with LoRA, forward through all then backward (the order a
micro-batch asks for their chunks), without and with checkpointing: each chunk dequantized where it is asked for
against the recomputation's weights kept for the input gradients, alone and with the next chunk dequantized on a
second stream during this one's GEMM (`mxfp4_experts.DequantizePrefetch`), and the same layers dense in bf16:
milliseconds of each, max abs difference of the output and gradients against dequantizing where asked (0 expected).
One JSON line, also in $OUT/mxfp4_prefetch.json.
"""

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ is beside finetune/, not installed

from benchmarks import mxfp4_checkpoints, mxfp4_dequantize_previous  # noqa: E402
from finetune.families import load_architecture  # noqa: E402
from finetune.models import (expert_lora, mxfp4_experts, mxfp4_grouped_gemm, mxfp4_loading,  # noqa: E402
                             mxfp4_triton)

GIB = 1 << 30
RANK = 16
# The GPU the check is for; a CPU (with TRITON_INTERPRET=1 and --architecture FOLDER of a tiny model) only runs its code
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"


synchronize = torch.cuda.synchronize if ON_GPU else (lambda: None)


def reset_peak() -> int:
    synchronize()
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() if ON_GPU else 0


def peak_since(base: int) -> float:
    return (torch.cuda.max_memory_allocated() - base) / GIB if ON_GPU else 0.0


def stored_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if not mxfp4_experts.is_placeholder(t))


def random_packed(experts, outputs, inputs, generator, scales=(118, 122)):
    shape = (experts, outputs, inputs // mxfp4_experts.BLOCK)
    return (torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, device=DEVICE, generator=generator),
            torch.randint(*scales, shape, dtype=torch.uint8, device=DEVICE, generator=generator))


def bit_equal(blocks, scales, dtype, dequantize=mxfp4_triton.dequantize, chunk=8):
    """Kernel against reference, `chunk` experts at a time (the reference's temporaries are 12 bytes per value)."""
    kernel = dequantize(blocks, scales, dtype)
    integer = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    return all(torch.equal(kernel[start:start + chunk].view(integer),
                           mxfp4_experts.dequantize(blocks[start:start + chunk], scales[start:start + chunk],
                                                    dtype).view(integer))
               for start in range(0, blocks.shape[0], chunk))


def moved_bytes(blocks, scales, dtype=torch.bfloat16):
    """What dequantizing a projection reads and writes: blocks, scales, and two values of `dtype` per byte."""
    return blocks.numel() + scales.numel() + 2 * dtype.itemsize * blocks.numel()


def kernel_variants(packed):
    """Each configuration of mxfp4_triton.CONFIGS, and the previous kernel, on each projection in bf16: milliseconds,
    GB/s, bit-equality with the reference. The fastest per projection is what the autotuning should pick."""
    variants = {f"{config.kwargs['BLOCK_IN']}x{config.kwargs['BLOCK_OUT']}, {config.num_warps} warps":
                functools.partial(mxfp4_triton.dequantize, config=config) for config in mxfp4_triton.CONFIGS}
    variants["previous kernel"] = mxfp4_dequantize_previous.dequantize
    result = {}
    for name, (blocks, scales) in packed.items():
        result[name] = {}
        for label, dequantize in variants.items():
            milliseconds = timed(functools.partial(dequantize, blocks, scales, torch.bfloat16), repeats=20)
            result[name][label] = {"ms": round(milliseconds, 3),
                                   "GBps": round(moved_bytes(blocks, scales) / milliseconds / 1e6, 1),
                                   "bit_equal": bit_equal(blocks, scales, torch.bfloat16, dequantize)}
    return result


def timed(function, repeats=5):
    """Mean milliseconds of `function()` after one warm-up call."""
    function()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    synchronize()
    return (time.perf_counter() - start) * 1000 / repeats


def experts_pair(config, packed):
    """The real GptOssExperts twice, the same weights: dense bf16, and resident in MXFP4."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    with torch.device("meta"):
        dense, resident = GptOssExperts(config), GptOssExperts(config)
    mxfp4_experts.make_resident(resident, DEVICE, torch.bfloat16)
    for name, (blocks, scales) in packed.items():
        getattr(resident, f"{name}_blocks").copy_(blocks)
        getattr(resident, f"{name}_scales").copy_(scales)
        setattr(dense, name, frozen(mxfp4_triton.dequantize(blocks, scales, torch.bfloat16)))
        for module in (dense, resident):
            setattr(module, f"{name}_bias", frozen(torch.full(blocks.shape[:2], 0.02, device=DEVICE)))
    return dense, resident


def frozen(tensor):
    return torch.nn.Parameter(tensor.to(torch.bfloat16), requires_grad=False)


def forward_backward(experts, hidden, indices, weights, adapters):
    """Output and the gradients of the input, the routing weights and every LoRA factor."""
    leaves = [hidden, weights, *(factor for lora_in, lora_out, _ in adapters.values() for factor in (lora_in, lora_out))]
    output = expert_lora.experts_forward(experts, hidden, indices, weights, adapters)
    return [output.detach(), *torch.autograd.grad(output.float().square().mean(), leaves)]


def expert_shapes(config) -> dict:
    """Each expert weight's (in, out)."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    return {"gate_up_proj": (hidden, 2 * intermediate), "down_proj": (intermediate, hidden)}


def random_adapters(shapes: dict, experts: int, generator) -> dict:
    """Expert weight name -> (L [experts, in, RANK], R [experts, RANK, out], scale), as expert_lora takes them."""
    return {name: tuple((torch.randn(experts, *shape, device=DEVICE, generator=generator) * 0.01)
                        .to(torch.bfloat16).requires_grad_() for shape in ((inputs, RANK), (RANK, outputs)))
            + (2.0,) for name, (inputs, outputs) in shapes.items()}


def layer_check(config, tokens, generator, variants):
    experts, hidden, intermediate = config.num_local_experts, config.hidden_size, config.intermediate_size
    shapes = expert_shapes(config)
    packed = {name: random_packed(experts, outputs, inputs, generator) for name, (inputs, outputs) in shapes.items()}
    every_scale = random_packed(experts, 2 * intermediate, hidden, generator, scales=(0, 255))
    result = {"kernel_bit_equal": {str(dtype): all(bit_equal(*pair, dtype) for pair in packed.values())
                                   for dtype in (torch.bfloat16, torch.float32)},
              "kernel_bit_equal_every_scale": {str(dtype): bit_equal(*every_scale, dtype)
                                               for dtype in (torch.bfloat16, torch.float32)}}
    milliseconds = timed(lambda: [mxfp4_triton.dequantize(*pair, torch.bfloat16) for pair in packed.values()])
    moved = sum(moved_bytes(*pair) for pair in packed.values())
    result["dequantize_layer_ms"] = round(milliseconds, 3)
    result["dequantize_GBps"] = round(moved / milliseconds / 1e6, 1)
    # (in/32, out, the tensors' dtypes) -> the configuration autotuning picked
    result["dequantize_autotuned"] = {str(key): str(config) for key, config in mxfp4_triton.autotuned_kernel.cache.items()}
    if variants:
        result["dequantize_variants"] = kernel_variants(packed)

    dense, resident = experts_pair(config, packed)
    hidden_states = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    logits = torch.randn(tokens, experts, device=DEVICE, generator=generator)
    top, indices = logits.topk(config.num_experts_per_tok, dim=-1)
    routing = torch.softmax(top, dim=-1).to(torch.bfloat16)
    adapters = random_adapters(shapes, experts, generator)
    runs = {}
    for label, module in (("dense", dense), ("resident", resident)):
        inputs = (hidden_states.clone().requires_grad_(), indices, routing.clone().requires_grad_())
        base = reset_peak()
        runs[label] = forward_backward(module, *inputs, adapters)
        peak = peak_since(base)
        milliseconds = timed(lambda module=module, inputs=inputs: forward_backward(module, *inputs, adapters))
        result[label] = {"fwd_bwd_ms": round(milliseconds, 2), "peak_above_weights_GiB": round(peak, 3),
                         "weights_GiB": round(stored_bytes(module) / GIB, 3)}
    names = ["output", "grad_hidden", "grad_routing", *(f"grad_{name}_{f}" for name in shapes for f in ("L", "R"))]
    result["max_abs_diff"] = {name: (a.float() - b.float()).abs().max().item()
                              for name, a, b in zip(names, runs["dense"], runs["resident"], strict=True)}
    result["resident_over_dense_time"] = round(result["resident"]["fwd_bwd_ms"] / result["dense"]["fwd_bwd_ms"], 3)
    return result


class DequantizedWhereAsked(mxfp4_experts.DequantizePrefetch):
    """Every chunk dequantized when its GEMM asks for it, as before the prefetch: nothing ahead, nothing kept."""

    def weight(self, blocks, scales, first, last, dtype, transposed):
        self.misses += 1
        return mxfp4_experts.dequantize_on_device(blocks[first:last], scales[first:last], dtype)


def prefetch_check(config, tokens, layers, generator):
    experts, hidden = config.num_local_experts, config.hidden_size
    shapes = expert_shapes(config)
    pairs = [experts_pair(config, {name: random_packed(experts, outputs, inputs, generator)
                                   for name, (inputs, outputs) in shapes.items()}) for _ in range(layers)]
    hidden_states = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    top, indices = torch.randn(tokens, experts, device=DEVICE, generator=generator).topk(config.num_experts_per_tok,
                                                                                        dim=-1)
    routing = torch.softmax(top, dim=-1).to(torch.bfloat16)
    adapters = [random_adapters(shapes, experts, generator) for _ in range(layers)]
    leaves = [factor for layer in adapters for lora_in, lora_out, _ in layer.values() for factor in (lora_in, lora_out)]

    def through_all(which: int, checkpointed: bool):
        inputs = hidden_states.clone().requires_grad_()
        output = inputs
        for pair, layer_adapters in zip(pairs, adapters, strict=True):
            layer = functools.partial(expert_lora.experts_forward, pair[which])
            output = torch.utils.checkpoint.checkpoint(layer, output, indices, routing, layer_adapters,
                                                       use_reentrant=False) if checkpointed else \
                layer(output, indices, routing, layer_adapters)
        return [output.detach(), *torch.autograd.grad(output.float().square().mean(), [inputs, *leaves])]

    result = {"layers": layers, "tokens": tokens}
    original = mxfp4_experts.PREFETCH
    for checkpointed in (False, True):
        runs, timings = {}, {}
        for label, which, prefetch in (("dense", 0, original),
                                       ("resident, dequantized where asked", 1, DequantizedWhereAsked()),
                                       ("resident, kept only", 1, mxfp4_experts.DequantizePrefetch(ahead=False)),
                                       ("resident, prefetched and kept", 1, mxfp4_experts.DequantizePrefetch())):
            mxfp4_experts.PREFETCH = prefetch
            base = reset_peak()
            milliseconds = timed(functools.partial(through_all, which, checkpointed))
            runs[label] = through_all(which, checkpointed)  # the prefetch's pass: every chunk dequantized ahead
            timings[label] = {"fwd_bwd_ms": round(milliseconds, 2), "peak_above_weights_GiB": round(peak_since(base), 3),
                              "hits": prefetch.hits, "reused": prefetch.reused, "misses": prefetch.misses}
        mxfp4_experts.PREFETCH = original
        for label, key in (("resident, kept only", "max_abs_diff_kept"),
                           ("resident, prefetched and kept", "max_abs_diff_prefetched")):
            pairs_of_runs = zip(runs["resident, dequantized where asked"], runs[label], strict=True)
            timings[key] = max((a.float() - b.float()).abs().max().item() for a, b in pairs_of_runs)
        for label in ("resident, dequantized where asked", "resident, kept only", "resident, prefetched and kept"):
            timings[f"{label} over dense time"] = round(timings[label]["fwd_bwd_ms"] / timings["dense"]["fwd_bwd_ms"],
                                                        3)
        result["checkpointing" if checkpointed else "no checkpointing"] = timings
    return result


def routed_offsets(tokens, experts, top, generator):
    """Each token sent to `top` distinct experts drawn uniformly -> where each expert's rows end (int32)."""
    chosen = torch.rand(tokens, experts, device=DEVICE, generator=generator).topk(top, dim=-1).indices
    return torch.bincount(chosen.flatten(), minlength=experts).cumsum(0).to(torch.int32)


def fused_gemm_check(config, token_counts, generator):
    """Per projection, per token count, forward and transposed: the chunked path against the fused kernel."""
    experts = config.num_local_experts
    shapes = expert_shapes(config)
    result = {}
    for name, (inputs, outputs) in shapes.items():
        blocks, scales = random_packed(experts, outputs, inputs, generator)
        # the chunked path's share that is dequantizing, all experts at once
        result[name] = {"dequantize_ms": round(timed(functools.partial(mxfp4_experts.dequantize_on_device, blocks,
                                                                       scales, torch.bfloat16)), 3)}
        for tokens in token_counts:
            offsets = routed_offsets(tokens, experts, config.num_experts_per_tok, generator)
            rows = tokens * config.num_experts_per_tok
            for transposed in (False, True):
                x = torch.randn(rows, outputs if transposed else inputs, device=DEVICE, generator=generator,
                                dtype=torch.bfloat16)
                operands = (x, blocks, scales, offsets, transposed)
                paths = {"chunked": functools.partial(mxfp4_experts._chunked_grouped_mm, *operands),
                         "fused": functools.partial(mxfp4_grouped_gemm.mxfp4_grouped_matmul, *operands)}
                chunked, fused = (run() for run in paths.values())
                moved = blocks.numel() + scales.numel() + x.numel() * x.element_size() + chunked.numel() * 2
                case = {"max_abs_diff": (fused.float() - chunked.float()).abs().max().item(),
                        "max_abs_reference": chunked.float().abs().max().item()}
                for label, run in paths.items():
                    milliseconds = timed(run, repeats=10 if ON_GPU else 1)  # the interpreter: the code only
                    case[f"{label}_ms"] = round(milliseconds, 3)
                    case[f"{label}_GBps"] = round(moved / milliseconds / 1e6, 1)
                    case[f"{label}_TFLOPs"] = round(2 * rows * inputs * outputs / milliseconds / 1e9, 1)
                case["fused_over_chunked_time"] = round(case["fused_ms"] / case["chunked_ms"], 3)
                result[name][f"{tokens} tokens, {'transposed' if transposed else 'forward'}"] = case
    return result


def load_check(config, folder: Path, generator):
    """Two layers written as the hub ships them, loaded resident: seconds, peak GPU memory (near the experts' bf16 size
    would mean a dense copy was made)."""
    config = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 2,
                                         "layer_types": config.layer_types[:2]})
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}

    def tensors():
        for name, shape in shapes.items():
            if name.endswith(mxfp4_checkpoints.EXPERT_WEIGHTS):
                experts, inputs, outputs = shape
                blocks, scales = random_packed(experts, outputs, inputs, generator)
                yield f"{name}_blocks", blocks.cpu()
                yield f"{name}_scales", scales.cpu()
            else:
                yield name, torch.randn(shape, device=DEVICE, generator=generator).to(torch.bfloat16).cpu()

    mxfp4_checkpoints.write_checkpoint(config, tensors(), folder, shard_bytes=1 << 30)
    stored = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    base = reset_peak()
    start = time.perf_counter()
    model = mxfp4_loading.load(str(folder), DEVICE, "bfloat16")
    synchronize()
    seconds = time.perf_counter() - start
    return {"load_2_layers_s": round(seconds, 2), "stored_GiB": round(stored / GIB, 3),
            "resident_GiB": round(stored_bytes(model) / GIB, 3), "load_peak_GiB": round(peak_since(base), 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", help="a hub id or a model folder (default gpt-oss-20b; with --fused_gemm, "
                                               "gpt-oss-120b and gpt-oss-20b)")
    parser.add_argument("--tokens", type=int, default=8192, help="routed tokens: batch 4 x 2048 by default")
    parser.add_argument("--kernel_variants", action="store_true",
                        help="also time each dequantization kernel configuration (and the previous kernel) alone")
    parser.add_argument("--fused_gemm", action="store_true",
                        help="only time the frozen expert GEMM: chunked dequantization against the fused kernel")
    parser.add_argument("--prefetch", action="store_true",
                        help="only time --layers layers of resident experts with and without the next chunk prefetched")
    parser.add_argument("--layers", type=int, default=4, help="with --prefetch: layers of experts in a row")
    parser.add_argument("--gemm_tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                        help="with --fused_gemm: the token counts of a micro-batch to route (4,096: 512 rows an "
                             "expert at GPT-OSS-20B, where the fused kernel's winning range may end)")
    args = parser.parse_args()
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    device = torch.cuda.get_device_name() if ON_GPU else "cpu"
    result = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
              "triton": triton.__version__}
    start = time.perf_counter()
    if args.fused_gemm:
        architectures = [args.architecture] if args.architecture else ["gpt-oss-120b", "gpt-oss-20b"]
        result["gemm_tokens"] = args.gemm_tokens
        result["fused_gemm"] = {architecture: fused_gemm_check(load_architecture(architecture), args.gemm_tokens,
                                                               generator) for architecture in architectures}
        # (rows rounded up to a power of two, experts, in/32, out, transposed, dtypes) -> the configuration picked
        result["fused_gemm_autotuned"] = {str(key): str(config) for key, config
                                          in mxfp4_grouped_gemm.autotuned_kernel.cache.items()}
        output_name = "mxfp4_fused_gemm.json"
    elif args.prefetch:
        architecture = args.architecture or "gpt-oss-20b"
        result["architecture"] = architecture
        result.update(prefetch_check(load_architecture(architecture), args.tokens, args.layers, generator))
        output_name = "mxfp4_prefetch.json"
    else:
        architecture = args.architecture or "gpt-oss-20b"
        result.update({"architecture": architecture, "tokens": args.tokens})
        config = load_architecture(architecture)
        result.update(layer_check(config, args.tokens, generator, args.kernel_variants))
        with tempfile.TemporaryDirectory(prefix="mxfp4-resident-") as folder:
            result.update(load_check(config, Path(folder), generator))
        output_name = "mxfp4_resident_check.json"
    result["seconds"] = round(time.perf_counter() - start, 1)
    line = json.dumps(result)
    print(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], output_name).write_text(line + "\n")


if __name__ == "__main__":
    main()
