"""KimiCheckpoint: reads only the tensors asked for from the shards model.safetensors.index.json
lists, after checking config.json, the index and each shard's header."""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..contract import ExactnessError
from ..formats import check_finite_tensor
from ..modules import PackedInt4Linear
from .config import KimiCheckpointError, KimiConfig, brief, json_object, read_json, shown_key
from .header import MAX_HEADER, TORCH_DTYPES, TensorEntry, parse_safetensors_header

# K2's names, K2.5's checkpoint (language_model.model.layers) and its transformers model
# (model.language_model.layers)
LAYERS = r"^(?:language_model\.)?model\.(?:language_model\.)?layers\.(\d+)\.mlp\."
ROUTED = re.compile(LAYERS + r"experts\.(\d+)\.(gate|up|down)_proj$")
SHARED_OR_DENSE = re.compile(LAYERS + r"(?:shared_experts\.)?(gate|up|down)_proj$")
PACKED_KEYS = ("weight_packed", "weight_scale", "weight_shape")
EXPECTED_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32}
# Kimi K2's quantization_config as it ships: the routed experts int4, every other Linear bf16
# (what check_quantization_config accepts; the tests' and benchmarks' checkpoints write it)
KIMI_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                  "weights": dict(EXPECTED_WEIGHTS)}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}

def check_quantization_config(config: dict, where: str) -> None:
    """Refuse anything but int4 symmetric group-32 pack-quantized compressed-tensors, on the
    weights only (quantized activations would be silently ignored)."""
    key, q = "quantization_config", config.get("quantization_config")
    if not q and isinstance(config.get("text_config"), dict):  # K2.5 nests it
        key, q = "text_config.quantization_config", config["text_config"].get(
            "quantization_config")
    if not q:
        raise KimiCheckpointError(f"{where}: no quantization_config (top level or text_config)")
    json_object(q, f"{where}: {key}")
    if q.get("quant_method") != "compressed-tensors":
        raise KimiCheckpointError(f"{where}: {key}.quant_method = {brief(q.get('quant_method'))}"
                                  f", expected 'compressed-tensors'")
    groups = q.get("config_groups")
    if not groups:
        raise KimiCheckpointError(f"{where}: {key}.config_groups: missing or empty")
    for name, group in json_object(groups, f"{where}: {key}.config_groups").items():
        at = f"{where}: {key}.config_groups.{shown_key(name)}"
        json_object(group, at)
        fmt = group.get("format", q.get("format"))
        if fmt != "pack-quantized":
            raise KimiCheckpointError(f"{at}.format = {brief(fmt)}, expected 'pack-quantized'")
        weights = json_object(group.get("weights"), f"{at}.weights")
        for k, want in EXPECTED_WEIGHTS.items():
            got = weights.get(k)
            if type(got) is not type(want) or got != want:  # 4.0 == 4 and 1 == True, but no
                raise KimiCheckpointError(f"{at}.weights.{k} = {brief(got)}, expected {want!r}")
        for k in ("input_activations", "output_activations"):
            if group.get(k) is not None:
                raise KimiCheckpointError(f"{at}.{k}: quantized activations are not supported "
                                          f"(they would be silently ignored), expected null")


@dataclass
class Shard:
    path: Path
    tensors: dict[str, TensorEntry]
    size: int  # the file's size when its header was read


class KimiCheckpoint:
    """A checkpoint directory: config.json, model.safetensors.index.json and its shards (or one
    model.safetensors). Headers are read and checked here, with plain reads; tensors are read
    through safetensors' `safe_open`, which maps each shard copy-on-write (a write to a tensor
    never reaches the file). Before each tensor the shard's size is looked at again: a file cut
    short under the reader is an error, not the SIGBUS of reading a mapped page past its end.
    `close()` drops the mappings (a mapped tensor keeps its own)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.bytes_read = 0
        self._shards: dict[str, Shard] = {}  # the index's file name -> the shard, header checked
        self._mapped: dict[Path, object] = {}  # shard path -> its safe_open handle
        self._read_config_and_index()

    def _read_config_and_index(self) -> None:
        config_file = self.dir / "config.json"
        if not config_file.is_file():
            raise KimiCheckpointError(f"{config_file}: missing")
        self.raw_config = json_object(read_json(config_file), str(config_file))
        check_quantization_config(self.raw_config, str(config_file))
        self.config = KimiConfig.from_json(self.raw_config, str(config_file))
        self.index_file = self.dir / "model.safetensors.index.json"
        if self.index_file.is_file():
            index = json_object(read_json(self.index_file), str(self.index_file))
            if "weight_map" not in index:
                raise KimiCheckpointError(f"{self.index_file}: weight_map: missing")
            self.weight_map = json_object(index["weight_map"], f"{self.index_file}: weight_map")
            for name, file_name in self.weight_map.items():
                if not isinstance(file_name, str) or not file_name:
                    raise KimiCheckpointError(f"{self.index_file}: weight_map.{shown_key(name)}: "
                                              f"expected a shard file name, got "
                                              f"{brief(file_name)}")
        elif (self.dir / "model.safetensors").is_file():
            self.index_file = self.dir / "model.safetensors"
            self.weight_map = dict.fromkeys(self._shard("model.safetensors").tensors,
                                            "model.safetensors")
        else:
            raise KimiCheckpointError(f"{self.index_file}: missing (and no single "
                                      f"model.safetensors)")

    def close(self) -> None:
        self._mapped.clear()

    def read_bytes(self, path: Path, offset: int, length: int) -> bytes:
        """Up to `length` bytes of `path` from `offset` (fewer where the file ends first): how
        headers are read."""
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read(length)

    def _read_exactly(self, path: Path, offset: int, length: int, where: str) -> bytes:
        try:
            data = self.read_bytes(path, offset, length)
        except OSError as e:
            raise KimiCheckpointError(f"{where}: read failed ({e})") from e
        if len(data) != length:
            raise KimiCheckpointError(f"{where}: truncated: {len(data)} of {length} bytes at "
                                      f"offset {offset}")
        return data

    def _shard(self, file_name: str) -> Shard:
        """The shard the index names `file_name`, its header read and checked once."""
        if file_name in self._shards:
            return self._shards[file_name]
        try:
            path = (self.dir / file_name).resolve()
            inside = not Path(file_name).is_absolute() and self.dir.resolve() in path.parents
            size = path.stat().st_size if inside and path.is_file() else None
        except (OSError, ValueError) as e:  # a name no file can have (a NUL byte, too long)
            raise KimiCheckpointError(f"{self.index_file}: shard {brief(file_name)}: not a "
                                      f"usable file name ({getattr(e, 'strerror', None) or e})"
                                      ) from e
        if not inside:
            raise KimiCheckpointError(f"{self.index_file}: shard {brief(file_name)} escapes "
                                      f"{self.dir}")
        if size is None:
            raise KimiCheckpointError(f"{self.index_file}: shard {brief(file_name)} is missing")
        if size < 8:
            raise KimiCheckpointError(f"{path}: truncated (no safetensors header)")
        header_len = int.from_bytes(self._read_exactly(path, 0, 8, f"{path}: header length"),
                                    "little")
        if header_len > MAX_HEADER or header_len > size - 8:
            raise KimiCheckpointError(f"{path}: header claims {header_len} bytes, the file has "
                                      f"{size}: refusing the allocation")
        raw = self._read_exactly(path, 8, header_len, f"{path}: header")
        tensors = parse_safetensors_header(raw, 8 + header_len, size - 8 - header_len, str(path))
        self._shards[file_name] = Shard(path, tensors, size)
        return self._shards[file_name]

    def name_for(self, module_name: str, key: str) -> str:
        """The checkpoint's name for a tensor, with or without the K2.5 prefix (and from
        transformers' K2.5 naming, model.language_model.*)."""
        name = f"{module_name}.{key}"
        if name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        for candidate in (name, name.removeprefix("language_model."), f"language_model.{name}"):
            if candidate in self.weight_map:
                return candidate
        raise KimiCheckpointError(f"tensor {name!r} is not in the checkpoint's weight_map")

    def entry(self, name: str) -> tuple[Shard, TensorEntry]:
        """The shard holding the tensor `name` (listed in the index) and its header entry."""
        shard = self._shard(self.weight_map[name])
        if name not in shard.tensors:
            raise KimiCheckpointError(f"{shard.path}: tensor {name!r}: not in the shard, though "
                                      f"{self.index_file.name} lists it there")
        return shard, shard.tensors[name]

    def check_packed(self, layer: PackedInt4Linear, module_name: str) -> None:
        """From the headers alone, everything about one projection's three tensors that a load
        would refuse: presence, dtypes and shapes. Their values (finite scales, weight_shape)
        are checked as they are read (`check_values`)."""
        for key, (shape, dtypes) in layer.expected_buffers().items():
            shard, entry = self.entry(self.name_for(module_name, key))
            where = f"{shard.path}: {module_name}: {key}"
            if TORCH_DTYPES.get(entry.dtype) not in dtypes:
                raise KimiCheckpointError(f"{where}: dtype {entry.dtype}, expected one of "
                                          f"{dtypes}")
            if entry.shape != shape:
                raise KimiCheckpointError(f"{where}: shape {entry.shape}, expected {shape}")

    def check_values(self, layer: PackedInt4Linear, module_name: str, key: str,
                     tensor: torch.Tensor) -> None:
        """What the headers cannot say about one of a projection's tensors, checked once as it
        is read: every scale finite, weight_shape the layer's [out, in]."""
        try:
            if key == "weight_scale":
                check_finite_tensor(tensor, "weight_scale")
            elif key == "weight_shape":
                got = [int(v) for v in tensor.tolist()]
                if got != [layer.out_features, layer.in_features]:
                    raise KimiCheckpointError(f"weight_shape: {got}, but the layer is "
                                              f"[{layer.out_features}, {layer.in_features}]")
        except ExactnessError as e:
            file = self.dir / self.weight_map[self.name_for(module_name, key)]
            raise KimiCheckpointError(f"{file}: {module_name}: {e}") from e

    def _map(self, shard: Shard):
        """The shard's safe_open handle (the library maps it, copy-on-write, and checks its
        header again: its refusal is named here)."""
        handle = self._mapped.get(shard.path)
        if handle is None:
            try:
                handle = self._mapped[shard.path] = safe_open(str(shard.path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise KimiCheckpointError(f"{shard.path}: safetensors refuses it ({e})") from e
        return handle

    def release(self, file_name: str) -> None:
        """Drop a shard's mapping once its tensors are read: its pages leave the process's
        resident memory (those of a mapped tensor stay, for as long as it lives)."""
        self._mapped.pop(self._shard(file_name).path, None)

    def read(self, name: str, device=None, *, mapped: bool = False,
             check: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """One tensor, in its stored dtype and shape (one of TORCH_DTYPES): a copy on `device`
        (the CPU by default), or with `mapped`, the file's own pages, copy-on-write. `check` runs
        on the mapped tensor before any copy."""
        shard, entry = self.entry(name)
        where = f"{shard.path}: tensor {name!r}"
        dtype = TORCH_DTYPES.get(entry.dtype)
        if dtype is None:
            raise KimiCheckpointError(f"{where}: dtype {entry.dtype}, not one this reader "
                                      f"loads ({', '.join(TORCH_DTYPES)})")
        view = self.map_tensor(shard, name, where)
        if view.dtype != dtype or tuple(view.shape) != entry.shape:
            raise KimiCheckpointError(f"{where}: safetensors reads {view.dtype} "
                                      f"{tuple(view.shape)}, the header says {entry.dtype} "
                                      f"{entry.shape}")
        if check is not None:
            check(view)
        self.bytes_read += entry.end - entry.begin
        if mapped and view.data_ptr() % view.element_size() == 0:
            return view
        return view.to(device or "cpu", copy=True)  # (a misaligned tensor is copied to align)

    def map_tensor(self, shard: Shard, name: str, where: str) -> torch.Tensor:
        """The tensor `name` of `shard` on its mapped pages, once the file is seen to be as long
        as when its header was read: the one place tensor data is reached."""
        try:
            size = os.stat(shard.path).st_size
        except OSError as e:
            raise KimiCheckpointError(f"{where}: read failed ({e})") from e
        if size != shard.size:
            what = "truncated" if size < shard.size else "grown"
            raise KimiCheckpointError(f"{where}: the file was {what} under the reader: {size} "
                                      f"bytes, {shard.size} when its header was read")
        try:
            return self._map(shard).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise KimiCheckpointError(f"{where}: read failed ({e})") from e

    def stream(self, wanted: dict, *, device=None, mapped: bool = False,
               check: Callable | None = None, progress: bool | None = None) -> dict:
        """{key: tensor} for `wanted` {key: the checkpoint's name}: read in file order, shard by
        shard, each shard's mapping dropped after its last tensor (unless `mapped`), so what
        the process holds beyond the tensors returned is one shard's pages at most.
        `check(key, tensor)` sees each tensor as stored before it is copied."""
        entries = {k: self.entry(name)[1] for k, name in wanted.items()}
        order = sorted(wanted, key=lambda k: (self.weight_map[wanted[k]], entries[k].begin))
        total = sum(e.end - e.begin for e in entries.values())
        bar = progress_bar(total, progress)
        out = {}
        try:
            for i, key in enumerate(order):
                name = wanted[key]
                before = self.bytes_read
                out[key] = self.read(name, device, mapped=mapped, check=None if check is None
                                     else functools.partial(check, key))
                last = i + 1 == len(order) or self.weight_map[wanted[order[i + 1]]] \
                    != self.weight_map[name]
                if last and not mapped:
                    self.release(self.weight_map[name])
                if bar is not None:
                    bar.update(self.bytes_read - before)
                    bar.set_postfix(tensors=f"{i + 1}/{len(order)}", refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return out

    def routed_experts(self) -> dict[tuple[int, int], list[str]]:
        """(layer, expert) -> its projection module names, as the checkpoint lists them."""
        found = {}
        for name in self.weight_map:
            if name.endswith(".weight_packed"):
                m = ROUTED.match(name.removesuffix(".weight_packed"))
                if m:
                    found.setdefault((int(m[1]), int(m[2])), []).append(
                        name.removesuffix(".weight_packed"))
        return found

    def read_packed(self, layer: PackedInt4Linear, module_name: str) -> dict[str, torch.Tensor]:
        """One projection's three tensors, checked (check_packed, check_values), on the layer's
        device (the CPU for a layer built on meta, to be assigned these very tensors)."""
        self.check_packed(layer, module_name)
        device = layer.weight_packed.device
        device = torch.device("cpu") if device.type == "meta" else device
        return {k: self.read(self.name_for(module_name, k), device, check=functools.partial(
            self.check_values, layer, module_name, k)) for k in PACKED_KEYS}

    def load_packed(self, layer: PackedInt4Linear, module_name: str) -> None:
        """Load one projection's three tensors; errors name the tensor and the file."""
        install(layer, self.read_packed(layer, module_name))


def install(layer: PackedInt4Linear, tensors: dict[str, torch.Tensor]) -> None:
    """Make checked tensors a layer's buffers, as they are: no copy, and no second check."""
    for key, tensor in tensors.items():
        layer.register_buffer(key, tensor)


def progress_bar(total: int, enabled: bool | None):
    """A tqdm bar over `total` bytes, or None: shown where `enabled`, or when None, where
    standard error is a terminal and the load is over 1 GiB."""
    if enabled is None:
        enabled = total > 2**30 and sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="exactness: loading")
