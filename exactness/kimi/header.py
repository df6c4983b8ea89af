"""A safetensors shard's header, each entry checked against the file before its data is read.

Read by hand, not through safe_open/get_slice, for one thing that API does not give: each
tensor's data offsets, by which the checkpoint reader streams a shard in file order and frees it
after its last tensor (safe_open still maps and reads the data, and checks the header again)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from .config import KimiCheckpointError, brief, json_object

MAX_HEADER = 100 * 2**20  # a safetensors header larger than this is refused, not allocated
# every dtype of the safetensors format, and its bits per element
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
              "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
              "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64}
# the dtypes this reader loads: a routed projection's (I32, I64, BF16) and the rest of a model's
TORCH_DTYPES = {"I32": torch.int32, "I64": torch.int64, "BF16": torch.bfloat16,
                "F16": torch.float16, "F32": torch.float32}

def _sizes(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header; begin and end are offsets in the file."""
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def parse_safetensors_header(raw: bytes, data_start: int, data_size: int,
                             where: str) -> dict[str, TensorEntry]:
    """The tensors a safetensors header lists, each checked: a dtype of the format, a shape of
    sizes, and data offsets inside the `data_size` bytes after the header, as many as the shape
    needs. `where` (the file) starts every error."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise KimiCheckpointError(f"{where}: header: not valid JSON ({e})") from e
    tensors = {}
    for name, entry in json_object(header, f"{where}: header").items():
        if name == "__metadata__":
            continue  # free-form; nothing read here depends on it
        at = f"{where}: tensor {name!r}"
        json_object(entry, at)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise KimiCheckpointError(f"{at}: unknown dtype {brief(dtype)}")
        if not _sizes(shape):
            raise KimiCheckpointError(f"{at}: shape {brief(shape)} is not a list of sizes")
        if not _sizes(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise KimiCheckpointError(f"{at}: data_offsets {brief(offsets)} are not "
                                      f"[begin, end]")
        if offsets[1] > data_size:
            raise KimiCheckpointError(f"{at}: data_offsets {offsets} run past the end of the "
                                      f"file ({data_size} bytes of data)")
        if math.prod(shape) * DTYPE_BITS[dtype] != 8 * (offsets[1] - offsets[0]):
            raise KimiCheckpointError(f"{at}: data_offsets hold {offsets[1] - offsets[0]} bytes "
                                      f"for shape {shape} of {dtype}")
        tensors[name] = TensorEntry(dtype, tuple(shape), data_start + offsets[0],
                                    data_start + offsets[1])
    return tensors
