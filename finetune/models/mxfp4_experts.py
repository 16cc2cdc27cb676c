"""GPT-OSS experts kept in MXFP4 and computed from it: the frozen expert weights stay as the checkpoint stores them
(`gate_up_proj_blocks`/`_scales`, `down_proj_blocks`/`_scales`, uint8) and are dequantized just before each grouped
GEMM, a chunk of experts at a time, in the forward and again in the backward, never saved, the next chunk on a second
stream while this one's GEMM runs; or, on a GPU where the experts get few rows each, decoded inside the GEMM's tiles
(finetune/models/mxfp4_grouped_gemm.py). FP4 values times a power of two are exact in bf16 and float32, so each GEMM
sees the very weight that dequantizing at load gives.

The format (benchmarks/mxfp4_checkpoints.py writes and reads it independently): a weight held [experts, in, out] in
memory is stored [experts, out, in / 32, 16]: 32 values along `in` share one E8M0 scale byte s (2**(s - 127)), two FP4
E2M1 values per byte, the even-indexed one in the low nibble.

`make_resident` turns a loaded-or-meta GPT-OSS experts module into one holding blocks and scales; its
`gate_up_proj`/`down_proj` become placeholders of the right shape, dtype and device that own one element (a
zero-stride view), so that peft's `target_parameters` builds its ParamWrapper and adapters exactly as on the
dequantized model (same keys and shapes). The arithmetic is expert_lora's: the frozen GEMM of `GroupedLoraMatmul`
reads blocks and scales through the `finetune::mxfp4_grouped_mm` operator here, opaque to torch.compile, so that no
compiled graph can keep the dequantized weight for the backward: what is kept, and for how long, is decided here
(`DequantizePrefetch`).
"""

import functools
import importlib
import weakref
from typing import NamedTuple

import torch

from finetune.families import DEQUANTIZE_AHEAD, dequantized_chunk_experts, fused_gemm_takes
from finetune.models import expert_lora

BLOCK = 32  # values that share one scale
SCALE_BIAS = 127
PACKED = ("_blocks", "_scales")
# FP4 E2M1 by its 4-bit code: sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """2**(s - 127) in float32, built from its bits: byte s is the float's exponent field (s = 0: 2**-127, the
    subnormal 0x00400000), so no exp2 rounding can enter."""
    bits = scales.to(torch.int32) << 23
    return torch.where(scales == 0, 0x00400000, bits).view(torch.float32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference: stored blocks [E, out, in/32, 16] and scales [E, out, in/32] -> weight [E, in, out] of `dtype`,
    contiguous as the dequantize-at-load path holds it. Each value is the float32 product of the FP4 value and the
    scale, rounded to `dtype` (exact for every scale a checkpoint uses)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    weights = (values * scale_values(scales).unsqueeze(-1)).to(dtype)  # [E, out, in/32, 32]
    experts, rows = weights.shape[:2]
    return weights.reshape(experts, rows, -1).transpose(1, 2).contiguous()


# 6 * 2**(253 - 127) is 2**128.6, past float32's and bf16's largest value (just under 2**128): from this scale byte up
# an FP4 value of the block can dequantize to infinity; 255 is NaN in the OCP MX format and 2**128 here
FIRST_OVERFLOWING_SCALE = 253


def nonfinite_scale(blocks: torch.Tensor, scales: torch.Tensor) -> int | None:
    """The first scale byte whose block `dequantize` turns into NaN or infinite values (255, or 253 and 254 times the
    larger FP4 values; transformers' dequantizer and the Triton kernel give the same infinities), None when there is
    none. FP4 values times powers of two are exact in float32 and bf16, so a value finite in one is finite in both;
    only the blocks of scales from FIRST_OVERFLOWING_SCALE up are dequantized, and only when there are such."""
    if scales.numel() == 0 or int(scales.max()) < FIRST_OVERFLOWING_SCALE:
        return None
    large = scales >= FIRST_OVERFLOWING_SCALE
    weights = dequantize(blocks[large][None, None], scales[large][None, None], torch.float32)
    overflowing = scales[large][~weights.reshape(-1, BLOCK).isfinite().all(dim=-1)]
    return int(overflowing[0]) if overflowing.numel() else None


def dequantize_on_device(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel on a CUDA GPU where triton is installed (bit-equal to `dequantize`), the reference elsewhere
    (without triton, with its larger temporaries)."""
    kernels = _triton_kernels("mxfp4_triton") if blocks.device.type == "cuda" else None
    return kernels.dequantize(blocks, scales, dtype) if kernels else dequantize(blocks, scales, dtype)


def without_triton() -> bool:
    return _triton_kernels("mxfp4_triton") is None


@functools.cache
def _triton_kernels(module: str):
    """finetune/models/`module`.py, or None where triton is not installed: asked once, not at every GEMM."""
    try:
        return importlib.import_module(f"finetune.models.{module}")
    except ImportError:
        return None


def in_features(blocks: torch.Tensor) -> int:
    return blocks.shape[-2] * BLOCK


# ---- The frozen GEMM from MXFP4 ----------------------------------------------------------------------------------


def _fused_gemm_kernel(x: torch.Tensor):
    """finetune/models/mxfp4_grouped_gemm.py where it can run: a CUDA tensor on a GPU with bf16 tensor cores (compute
    capability 8.0, as torch._grouped_mm needs), triton installed."""
    if not x.is_cuda or not expert_lora.bf16_tensor_cores(x.device):
        return None
    return _triton_kernels("mxfp4_grouped_gemm")


def _mxfp4_grouped_mm(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                      transposed: bool) -> torch.Tensor:
    """The fused kernel, which reads 4.25 bits a weight inside its tiles instead of writing a chunk of experts in bf16
    and reading it back, where the experts get few rows (on average: counting them would read the offsets back);
    cuBLAS's grouped GEMM after dequantizing, which wins once they get many, elsewhere."""
    fused = _fused_gemm_kernel(x) if fused_gemm_takes(x.shape[0], blocks.shape[0]) else None
    if fused is not None:
        return fused.mxfp4_grouped_matmul(x, blocks, scales, offsets, transposed)
    return _chunked_grouped_mm(x, blocks, scales, offsets, transposed)


def _chunked_grouped_mm(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                        transposed: bool) -> torch.Tensor:
    """Each chunk of experts is dequantized and multiplied with its own rows only (x is sorted by expert): the same
    GEMMs as over the whole projection, with a fraction of its dequantized weight alive at a time."""
    experts = blocks.shape[0]
    chunk = dequantized_chunk_experts(blocks[0].numel() * 2 * x.element_size(), experts)
    if chunk == experts:
        weight = PREFETCH.weight(blocks, scales, 0, experts, x.dtype, transposed)
        return expert_lora.grouped_mm(x, weight.transpose(-2, -1) if transposed else weight, offsets)
    ends = offsets.tolist()  # where each chunk's rows begin and end: one read back per projection
    output = x.new_zeros(x.shape[0], in_features(blocks) if transposed else blocks.shape[1])
    for first in range(0, experts, chunk):
        last = min(first + chunk, experts)
        start, stop = (ends[first - 1] if first else 0), ends[last - 1]
        if stop == start:
            continue
        weight = PREFETCH.weight(blocks, scales, first, last, x.dtype, transposed)
        output[start:stop] = expert_lora.grouped_mm(x[start:stop], weight.transpose(-2, -1) if transposed else weight,
                                                    offsets[first:last] - start)
        del weight  # before the next chunk is asked for (which, dequantizing ahead, starts the one after it): one alive
        # at a time, or two dequantizing ahead, not three
    return output


class DequantizePrefetch:
    """The next chunk of experts dequantized on a second CUDA stream while this chunk's grouped GEMM runs, and with
    checkpointing, a layer's whole projections dequantized for its recomputation kept for its input gradients.

    A training step asks for the same chunks in the same order every micro-batch: each layer's gate_up then down in
    the forward; in the backward (with checkpointing) each layer's recomputation, gate_up then down, then its input
    gradients, down then gate_up transposed. So each request remembers which request followed it last time, and has
    that one's weight dequantized beside its own GEMM, which at many rows an expert is bound by arithmetic while the
    dequantization (4.25 bits read, 16 written a weight) is bound by memory bandwidth. A request is its experts'
    blocks, its first and last experts, the direction and whether autograd's backward is running (which tells the
    recomputation from the forward, whose chunks come in the same order). A request that is not the one prefetched
    (another order, the first of a run) is dequantized where it is asked and the prefetched weight is dropped. A
    recomputation's whole projection (all its experts in one chunk) is kept until its transposed product asks for it,
    a few GEMMs later: two passes over the weights a micro-batch instead of three. At most two chunks are
    dequantized at a time, or, with checkpointing and whole projections, one layer's two and the next one's. On a
    CPU the next chunk is dequantized before it is asked for, in the same stream. With `ahead` false (as training
    runs: families.DEQUANTIZE_AHEAD) nothing is dequantized before it is asked for and no order is learned: one chunk
    at a time, or the recomputation's projections kept, one layer's two (what the planner counts)."""

    def __init__(self, ahead: bool = True):
        self.ahead = ahead
        self._followers: dict[_Request, tuple] = {}
        self._last_request: _Request | None = None
        self._pending: _Dequantized | None = None
        self._kept: dict[tuple, _Dequantized] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.hits = self.reused = self.misses = 0

    def weight(self, blocks: torch.Tensor, scales: torch.Tensor, first: int, last: int, dtype: torch.dtype,
               transposed: bool) -> torch.Tensor:
        """Experts first..last-1 of blocks and scales dequantized to `dtype`, [experts, in, out]."""
        if blocks.is_cuda and torch.cuda.is_current_stream_capturing():
            # a CUDA graph (compile mode reduce-overhead) replays the kernels captured, not this bookkeeping
            return dequantize_on_device(blocks[first:last], scales[first:last], dtype)
        request = _Request(id(blocks), first, last, transposed, torch._C._current_graph_task_id() != -1)
        pending, self._pending = self._pending, None
        kept = self._kept.pop(request.chunk, None) if request.input_gradient else None
        previous = self._last_request
        if not request.in_backward or (request.recomputing and not (previous is not None and previous.recomputing)):
            # a forward, or a layer's recomputation begins: what an earlier layer kept is asked for no more (its
            # input gradient came, or never will: another tensor than the one kept, no gradient wanted)
            self._kept.clear()
        if (weight := _ready(kept, blocks, scales, first, last, dtype)) is not None:
            self.reused += 1
        elif (weight := _ready(pending, blocks, scales, first, last, dtype)) is not None:
            self.hits += 1
        else:
            self.misses += 1
            weight = dequantize_on_device(blocks[first:last], scales[first:last], dtype)
        if request.recomputing and last - first == blocks.shape[0]:
            self._kept[request.chunk] = _Dequantized(blocks, scales, first, last, dtype, weight, None)
        self._last_request = request
        if self.ahead:
            if previous is not None:
                self._followers[previous] = (weakref.ref(blocks), weakref.ref(scales), dtype, request)
            self._start(self._followers.get(request))
        return weight

    def release(self) -> None:
        """Nothing held: no weight dequantized ahead or kept, no order remembered (training is over)."""
        self._followers.clear()
        self._kept.clear()
        self._last_request = self._pending = None

    def _start(self, follower: tuple | None) -> None:
        blocks, scales = (follower[0](), follower[1]()) if follower else (None, None)
        if blocks is None or scales is None:
            return
        dtype, request = follower[2:]
        if request.input_gradient and request.chunk in self._kept:
            return
        first, last = request.first, request.last
        ready = None
        if blocks.is_cuda:
            side = self._side_stream(blocks.device)
            side.wait_stream(torch.cuda.current_stream(blocks.device))  # whatever this stream still writes to them
            with torch.cuda.stream(side):
                weight = dequantize_on_device(blocks[first:last], scales[first:last], dtype)
                ready = torch.cuda.Event()
                ready.record(side)
            blocks.record_stream(side)
            scales.record_stream(side)
        else:
            weight = dequantize_on_device(blocks[first:last], scales[first:last], dtype)
        self._pending = _Dequantized(blocks, scales, first, last, dtype, weight, ready)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            # high priority: its few blocks go to the first free multiprocessors, done before the next GEMM needs them
            self._streams[device] = torch.cuda.Stream(device, priority=-1)
        return self._streams[device]


class _Request(NamedTuple):
    """What asks for a chunk: its experts' blocks (by identity), the chunk's first and last experts, the direction,
    and whether autograd's backward is running."""
    blocks: int
    first: int
    last: int
    transposed: bool
    in_backward: bool

    @property
    def chunk(self) -> tuple[int, int, int]:
        return self.blocks, self.first, self.last

    @property
    def recomputing(self) -> bool:
        """A checkpointed layer's forward run again in the backward."""
        return self.in_backward and not self.transposed

    @property
    def input_gradient(self) -> bool:
        return self.in_backward and self.transposed


class _Dequantized:
    """A chunk's dequantized weight, what it was dequantized from (held: its memory cannot be reused meanwhile) and,
    when a second stream dequantized it, the event that says it is done."""

    def __init__(self, blocks, scales, first, last, dtype, weight, ready):
        self.source = (blocks, scales, first, last, dtype)
        self.versions = _versions(blocks, scales)
        self.weight, self.ready = weight, ready


def _versions(blocks: torch.Tensor, scales: torch.Tensor) -> tuple:
    """What changes when a tensor is written in place (its version) or given other memory (`.data = ...`)."""
    return blocks._version, scales._version, blocks.data_ptr(), scales.data_ptr()


def _ready(held: _Dequantized | None, blocks, scales, first, last, dtype) -> torch.Tensor | None:
    """The held weight where it is this chunk's, from these very tensors unchanged since, for use on this stream."""
    if held is None:
        return None
    source_blocks, source_scales, *chunk = held.source
    if not (source_blocks is blocks and source_scales is scales and chunk == [first, last, dtype]
            and held.versions == _versions(blocks, scales)):
        return None
    if held.ready is not None:
        stream = torch.cuda.current_stream(held.weight.device)
        stream.wait_event(held.ready)
        held.weight.record_stream(stream)  # its memory, the side stream's, is not reused before this stream is done
    return held.weight


PREFETCH = DequantizePrefetch(ahead=DEQUANTIZE_AHEAD)


def _mxfp4_grouped_mm_fake(x, blocks, scales, offsets, transposed):
    return x.new_empty(x.shape[0], in_features(blocks) if transposed else blocks.shape[1])


# A custom operator: the dequantized weight is a temporary inside it, so a compiled layer's partitioner cannot choose
# to save it for the backward (the backward calls the operator again, transposed).
torch.library.custom_op("finetune::mxfp4_grouped_mm", _mxfp4_grouped_mm, mutates_args=(),
                        schema="(Tensor x, Tensor blocks, Tensor scales, Tensor offsets, bool transposed) -> Tensor")
torch.library.register_fake("finetune::mxfp4_grouped_mm", _mxfp4_grouped_mm_fake)


def grouped_mm(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
               transposed: bool = False) -> torch.Tensor:
    """expert_lora.grouped_mm with the weight [E, in, out] (transposed: its transpose) given as blocks and scales."""
    return torch.ops.finetune.mxfp4_grouped_mm(x, blocks, scales, offsets, transposed)


# ---- The resident experts module ----------------------------------------------------------------------------------


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.nn.Parameter:
    """A frozen parameter of this shape, dtype and device owning one element: what peft reads of an expert weight."""
    return torch.nn.Parameter(torch.zeros((), dtype=dtype, device=device).expand(shape), requires_grad=False)


def is_placeholder(tensor: torch.Tensor) -> bool:
    return tensor.dim() > 0 and not any(tensor.stride())


class ResidentExperts:
    """Mixed into a GPT-OSS experts class by `make_resident`: the forward without expert adapters (attention-only
    LoRA, evaluation, no LoRA) is expert_lora's grouped path with no adapters."""

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        if torch.nn.utils.parametrize.is_parametrized(self):
            # peft's own expert LoRA adds B·A to the placeholder weights; the packed weights cannot take it
            raise RuntimeError("experts kept in MXFP4 train expert LoRA only through finetune's grouped path "
                               "(expert_lora_kernel: grouped, one adapter, not merged)")
        return expert_lora.experts_forward(self, hidden_states, router_indices, routing_weights, {})


_resident_classes: dict[type, type] = {}


def _resident_class(cls: type) -> type:
    if cls not in _resident_classes:
        _resident_classes[cls] = type(f"Mxfp4{cls.__name__}", (ResidentExperts, cls), {})
    return _resident_classes[cls]


def fits(experts: torch.nn.Module) -> bool:
    """A GPT-OSS experts module: weights [E, in, out] and the gate between them (what experts_forward computes)."""
    return (all(isinstance(getattr(experts, name, None), torch.Tensor) for name in expert_lora.EXPERT_WEIGHTS)
            and getattr(experts, "is_transposed", False) and hasattr(experts, "_apply_gate"))


def make_resident(experts: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace the module's expert weights by empty blocks and scales on `device` (filled by the loader) and
    placeholders of `dtype`, the dtype the experts compute in."""
    for name in expert_lora.EXPERT_WEIGHTS:
        experts_count, inputs, outputs = getattr(experts, name).shape
        delattr(experts, name)
        shape = (experts_count, outputs, inputs // BLOCK)
        experts.register_buffer(f"{name}_blocks", torch.empty(*shape, BLOCK // 2, dtype=torch.uint8, device=device))
        experts.register_buffer(f"{name}_scales", torch.empty(shape, dtype=torch.uint8, device=device))
        setattr(experts, name, placeholder(torch.Size((experts_count, inputs, outputs)), dtype, device))
    experts.__class__ = _resident_class(type(experts))
