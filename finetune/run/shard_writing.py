"""A model written as safetensors shards a piece of a tensor at a time, never held whole: `safetensors` writes a file
only from every tensor's bytes at once (its header gives each tensor's offset), so a merged 120B model would be held
one 4 GiB shard at a time. Here each file's header is written first, from the names, dtypes and shapes alone, and each
tensor's bytes at their offset as its leading rows come; the files, their names and model.safetensors.index.json are
those `save_pretrained(max_shard_size=...)` writes for the same tensors (huggingface_hub's split into shards).
"""

import json
import os
import struct
from pathlib import Path

import torch

# safetensors' names of the dtypes a model's tensors have (its format's list, https://github.com/huggingface/safetensors)
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
FORMAT = {"format": "pt"}  # what from_pretrained requires of a safetensors file's metadata
HEADER_ALIGNMENT = 8  # safetensors pads its header so that the data starts 8-byte aligned


class SafetensorsFile:
    """One safetensors file of the tensors in `planned` (any tensors of the right shapes and dtypes, meta ones
    included): the header at once, each tensor's bytes by `write`, its leading rows first. Tensors are laid out as
    safetensors lays them out, the largest dtypes first, then by name, so every tensor is aligned to its dtype."""

    def __init__(self, path: Path, planned: dict[str, torch.Tensor]):
        order = sorted(planned, key=lambda name: (-planned[name].element_size(), name))
        header, end = {"__metadata__": FORMAT}, 0
        self._sizes = {}
        for name in order:
            tensor = planned[name]
            self._sizes[name] = tensor.numel() * tensor.element_size()
            header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                            "data_offsets": [end, end + self._sizes[name]]}
            end += self._sizes[name]
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)
        data_start = 8 + len(encoded)
        self._starts = {name: data_start + header[name]["data_offsets"][0] for name in order}
        self._planned = {name: (tensor.dtype, tuple(tensor.shape[1:])) for name, tensor in planned.items()}
        self._written = dict.fromkeys(order, 0)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._file.truncate(data_start + end)

    def write(self, name: str, rows: torch.Tensor) -> None:
        """The next leading rows of tensor `name` (all of it for a tensor without rows)."""
        dtype, row_shape = self._planned[name]
        if rows.dtype != dtype or tuple(rows.shape[1:]) != row_shape:
            raise ValueError(f"{name}: rows of {rows.dtype} {tuple(rows.shape)}, planned {dtype} rows of {row_shape}")
        data = memoryview(rows.contiguous().reshape(-1).view(torch.uint8).numpy())
        if self._written[name] + len(data) > self._sizes[name]:
            raise ValueError(f"{name}: {self._written[name] + len(data)} bytes written, planned {self._sizes[name]}")
        position = self._starts[name] + self._written[name]
        while data:  # one pwrite writes at most ~2 GiB
            done = os.pwrite(self._file.fileno(), data, position)
            data, position = data[done:], position + done
        self._written[name] = position - self._starts[name]

    def complete(self) -> bool:
        return self._written == self._sizes

    def close(self) -> None:
        missing = sorted(name for name, size in self._sizes.items() if self._written[name] != size)
        self._file.close()
        if missing:
            raise RuntimeError(f"{self._file.name}: tensors not written whole: {', '.join(missing)}")


class ShardedModel:
    """A model folder's weight files, `planned` (name -> a tensor of its shape and dtype, in state_dict order) cut
    into shards of at most `max_shard_bytes` as save_pretrained cuts them; each file is opened at its first write and
    closed at its last."""

    def __init__(self, folder: Path, planned: dict[str, torch.Tensor], max_shard_bytes: int, total_parameters: int):
        from huggingface_hub import split_torch_state_dict_into_shards
        from transformers.utils import SAFE_WEIGHTS_NAME

        self._folder, self._planned, self._total_parameters = folder, planned, total_parameters
        pattern = SAFE_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors")
        self._split = split_torch_state_dict_into_shards(planned, filename_pattern=pattern,
                                                         max_shard_size=max_shard_bytes)
        self._open: dict[str, SafetensorsFile] = {}
        self._closed: set[str] = set()

    def write(self, name: str, rows: torch.Tensor) -> None:
        filename = self._split.tensor_to_filename[name]
        if filename not in self._open:
            if filename in self._closed:
                raise ValueError(f"{name}: {filename} is already written whole")
            names = self._split.filename_to_tensors[filename]
            self._open[filename] = SafetensorsFile(self._folder / filename, {key: self._planned[key] for key in names})
        self._open[filename].write(name, rows)
        if self._open[filename].complete():
            self._open.pop(filename).close()
            self._closed.add(filename)

    def close(self) -> None:
        """Every file written whole, then the index, as save_pretrained writes it (for more than one file)."""
        from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

        unwritten = sorted(set(self._split.filename_to_tensors) - self._closed - set(self._open))
        for shard in self._open.values():
            shard.close()
        if unwritten:
            raise RuntimeError(f"{self._folder}: shards never written: {', '.join(unwritten)}")
        if self._split.is_sharded:
            index = {"metadata": {"total_parameters": self._total_parameters, **self._split.metadata},
                     "weight_map": self._split.tensor_to_filename}
            content = json.dumps(index, indent=2, sort_keys=True) + "\n"
            (self._folder / SAFE_WEIGHTS_INDEX_NAME).write_text(content)
