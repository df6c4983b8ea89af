"""Kimi K2 Thinking / K2.5: exact routed experts, the converter, and a reader of real shards.

- `KimiMLP`, `KimiMoE`, `KimiModel`: a faithful minimal MoE stack with Kimi's module names
  (`model.layers.L.mlp.experts.E.{gate,up,down}_proj`, shared experts, the layer-0 dense MLP,
  the sigmoid router with `e_score_correction_bias`). Routed experts are `PackedInt4Linear` when
  `config.use_exact_generators` is true; shared experts and the dense MLP stay `nn.Linear`.
- `KimiCheckpoint`: reads only the tensors asked for from the safetensors shards listed in
  `model.safetensors.index.json`, after checking config.json, the index and each shard's header;
  anything malformed in them is a `KimiCheckpointError` that names the file and the key. The
  tensors stream through safetensors' `safe_open` (mapped), shard by shard.
- `convert_kimi_to_exact`: swaps routed-expert projections for loaded `PackedInt4Linear`s (zero
  conversion of the int4 weights), all or nothing: every read and check comes before the swap.
  Options for K2's size: `device=`, `mmap=True`, `experts=` / `rank=`, `world=`, `progress=`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .contract import DEFAULT_ACT_BITS, ExactnessError, check_act_bits
from .formats import check_finite_tensor
from .kernels.routing import check_routing
from .modules import ExactLinear, PackedInt4Linear
from .moe import RemoteLinear, activation, experts_forward


class KimiCheckpointError(ExactnessError, ValueError):
    """A checkpoint that is not what Kimi's native int4 format promises; names file and tensor."""


class KimiConversionError(ExactnessError, ValueError):
    """A model that convert_kimi_to_exact cannot convert faithfully; names the module."""


def _short(value) -> str:
    """repr(value) cut to a short single line, for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _key(name: str) -> str:
    """A JSON key for a message: as it is, or quoted where it would break the line."""
    return name if name.isprintable() else repr(name)


def _json_kind(value) -> str:
    if value is None:
        return "null or nothing"
    return {bool: "a bool", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _object(value, where: str) -> dict:
    """value, which must be a JSON object."""
    if not isinstance(value, dict):
        raise KimiCheckpointError(f"{where}: expected a JSON object, got {_json_kind(value)}")
    return value


def _read_json(path: Path):
    try:
        return json.loads(path.read_bytes())
    except OSError as e:
        raise KimiCheckpointError(f"{path}: unreadable ({e})") from e
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, nesting too deep
        raise KimiCheckpointError(f"{path}: not valid JSON ({e})") from e


@dataclass
class KimiConfig:
    hidden_size: int = 7168
    moe_intermediate_size: int = 2048
    intermediate_size: int = 18432
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    num_hidden_layers: int = 61
    routed_scaling_factor: float = 2.827
    norm_topk_prob: bool = True
    use_exact_generators: bool = True
    exact_act_bits: int = DEFAULT_ACT_BITS

    @classmethod
    def from_json(cls, config: dict, where: str = "config.json") -> KimiConfig:
        """The fields of a config.json (K2.5: of its text_config) that this class knows, each
        type-checked; the routed experts' two sizes must be there."""
        text, at = _object(config, where), ""
        if "text_config" in config:  # K2.5 nests the language model's config
            text, at = _object(config["text_config"], f"{where}: text_config"), "text_config."
        known = {}
        for name, f in cls.__dataclass_fields__.items():
            if name not in text:
                if name in ("hidden_size", "moe_intermediate_size"):
                    raise KimiCheckpointError(f"{where}: {at}{name}: missing")
                continue
            known[name] = _config_value(name, text[name], type(f.default), f"{where}: {at}{name}")
        return cls(**known)


def _config_value(name: str, value, kind: type, where: str):
    """One config.json field, checked against the type of its KimiConfig default."""
    if kind is bool:
        ok, what = isinstance(value, bool), "a bool"
    elif kind is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        ok, what = number and math.isfinite(value), "a finite number"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        what = "an int >= 0"
    if not ok:
        raise KimiCheckpointError(f"{where}: expected {what}, got {_short(value)}")
    if name in ("hidden_size", "moe_intermediate_size") and (value == 0 or value % 32):
        raise KimiCheckpointError(f"{where}: {value} is not a multiple of 32 (the int4 group)")
    if name == "exact_act_bits":
        try:
            check_act_bits(value)
        except ExactnessError as e:
            raise KimiCheckpointError(f"{where}: {e}") from e
    return value


# --------------------------------------------------------------------------- the model


class KimiMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); exact int4 projections for routed experts."""

    def __init__(self, config: KimiConfig, intermediate_size: int, routed: bool = False):
        super().__init__()
        hidden = config.hidden_size
        if routed and config.use_exact_generators:
            def make(i, o):
                return PackedInt4Linear(i, o, act_bits=config.exact_act_bits)
        else:
            def make(i, o):
                return nn.Linear(i, o, bias=False, dtype=torch.bfloat16)
        self.gate_proj = make(hidden, intermediate_size)
        self.up_proj = make(hidden, intermediate_size)
        self.down_proj = make(intermediate_size, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(nn.functional.silu, self.gate_proj(x), self.up_proj(x)))


class KimiRouter(nn.Module):
    """Sigmoid scores; top-k on scores + e_score_correction_bias; weights from the unbiased
    scores, normalised, times routed_scaling_factor (noaux_tc with one group)."""

    def __init__(self, config: KimiConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size,
                                               dtype=torch.bfloat16))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        chosen = torch.topk(scores + self.e_score_correction_bias, self.config.num_experts_per_tok,
                            dim=-1, sorted=True).indices
        weights = scores.gather(-1, chosen)
        if self.config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.config.routed_scaling_factor


class KimiMoE(nn.Module):
    """Routed experts (one grouped call per projection where they are exact: exactness.moe; the
    per-expert loop with `grouped = False`), shared experts, the router; sums in fp32."""

    def __init__(self, config: KimiConfig, grouped: bool = True):
        super().__init__()
        self.config, self.grouped = config, grouped
        self.experts = nn.ModuleList(KimiMLP(config, config.moe_intermediate_size, routed=True)
                                     for _ in range(config.n_routed_experts))
        self.gate = KimiRouter(config)
        self.shared_experts = KimiMLP(config,
                                      config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights = self.gate(x)
        routed = (experts_forward(self.experts, nn.functional.silu, x, chosen, weights,
                                  torch.float32, lambda: self.per_expert(x, chosen, weights))
                  if self.grouped else self.per_expert(x, chosen, weights))
        return (routed + self.shared_experts(x).float()).to(x.dtype).reshape(shape)

    def per_expert(self, x: torch.Tensor, chosen: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
        """The routed experts one by one: the reference the grouped call is checked against."""
        check_routing(chosen.to(torch.int64), len(self.experts))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(chosen).tolist():  # each expert sees only its tokens
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            out.index_add_(0, token, weights[token, slot, None] * self.experts[e](x[token]).float())
        return out


class KimiDecoderLayer(nn.Module):
    """Only what the experts need: the MLP (attention and norms stay out of this project)."""

    def __init__(self, config: KimiConfig, index: int):
        super().__init__()
        dense = index < config.first_k_dense_replace
        self.mlp = KimiMLP(config, config.intermediate_size) if dense else KimiMoE(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class KimiInner(nn.Module):
    def __init__(self, config: KimiConfig):
        super().__init__()
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))


class KimiModel(nn.Module):
    """`model.layers...` (K2 Thinking); wrap in `KimiK25` for the `language_model.` prefix."""

    def __init__(self, config: KimiConfig):
        super().__init__()
        self.config = config
        self.model = KimiInner(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return x


class KimiK25(nn.Module):
    def __init__(self, config: KimiConfig):
        super().__init__()
        self.language_model = KimiModel(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.language_model(x)


# --------------------------------------------------------------------------- checkpoints

# K2's names, K2.5's checkpoint (language_model.model.layers) and its transformers model
# (model.language_model.layers)
LAYERS = r"^(?:language_model\.)?model\.(?:language_model\.)?layers\.(\d+)\.mlp\."
ROUTED = re.compile(LAYERS + r"experts\.(\d+)\.(gate|up|down)_proj$")
SHARED_OR_DENSE = re.compile(LAYERS + r"(?:shared_experts\.)?(gate|up|down)_proj$")
PACKED_KEYS = ("weight_packed", "weight_scale", "weight_shape")
MAX_HEADER = 100 * 2**20  # a safetensors header larger than this is refused, not allocated
EXPECTED_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32}
# every dtype of the safetensors format, and its bits per element
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
              "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
              "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64}
# the dtypes this reader loads: a routed projection's (I32, I64, BF16) and the rest of a model's
TORCH_DTYPES = {"I32": torch.int32, "I64": torch.int64, "BF16": torch.bfloat16,
                "F16": torch.float16, "F32": torch.float32}


def check_quantization_config(config: dict, where: str) -> None:
    """Refuse anything but int4 symmetric group-32 pack-quantized compressed-tensors, on the
    weights only (quantized activations would be silently ignored)."""
    key, q = "quantization_config", config.get("quantization_config")
    if not q and isinstance(config.get("text_config"), dict):  # K2.5 nests it
        key, q = "text_config.quantization_config", config["text_config"].get(
            "quantization_config")
    if not q:
        raise KimiCheckpointError(f"{where}: no quantization_config (top level or text_config)")
    _object(q, f"{where}: {key}")
    if q.get("quant_method") != "compressed-tensors":
        raise KimiCheckpointError(f"{where}: {key}.quant_method = {_short(q.get('quant_method'))}"
                                  f", expected 'compressed-tensors'")
    groups = q.get("config_groups")
    if not groups:
        raise KimiCheckpointError(f"{where}: {key}.config_groups: missing or empty")
    for name, group in _object(groups, f"{where}: {key}.config_groups").items():
        at = f"{where}: {key}.config_groups.{_key(name)}"
        _object(group, at)
        fmt = group.get("format", q.get("format"))
        if fmt != "pack-quantized":
            raise KimiCheckpointError(f"{at}.format = {_short(fmt)}, expected 'pack-quantized'")
        weights = _object(group.get("weights"), f"{at}.weights")
        for k, want in EXPECTED_WEIGHTS.items():
            got = weights.get(k)
            if type(got) is not type(want) or got != want:  # 4.0 == 4 and 1 == True, but no
                raise KimiCheckpointError(f"{at}.weights.{k} = {_short(got)}, expected {want!r}")
        for k in ("input_activations", "output_activations"):
            if group.get(k) is not None:
                raise KimiCheckpointError(f"{at}.{k}: quantized activations are not supported "
                                          f"(they would be silently ignored), expected null")


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
    for name, entry in _object(header, f"{where}: header").items():
        if name == "__metadata__":
            continue  # free-form; nothing read here depends on it
        at = f"{where}: tensor {name!r}"
        _object(entry, at)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise KimiCheckpointError(f"{at}: unknown dtype {_short(dtype)}")
        if not _sizes(shape):
            raise KimiCheckpointError(f"{at}: shape {_short(shape)} is not a list of sizes")
        if not _sizes(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise KimiCheckpointError(f"{at}: data_offsets {_short(offsets)} are not "
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
        self.raw_config = _object(_read_json(config_file), str(config_file))
        check_quantization_config(self.raw_config, str(config_file))
        self.config = KimiConfig.from_json(self.raw_config, str(config_file))
        self.index_file = self.dir / "model.safetensors.index.json"
        if self.index_file.is_file():
            index = _object(_read_json(self.index_file), str(self.index_file))
            if "weight_map" not in index:
                raise KimiCheckpointError(f"{self.index_file}: weight_map: missing")
            self.weight_map = _object(index["weight_map"], f"{self.index_file}: weight_map")
            for name, file_name in self.weight_map.items():
                if not isinstance(file_name, str) or not file_name:
                    raise KimiCheckpointError(f"{self.index_file}: weight_map.{_key(name)}: "
                                              f"expected a shard file name, got "
                                              f"{_short(file_name)}")
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
            raise KimiCheckpointError(f"{self.index_file}: shard {_short(file_name)}: not a "
                                      f"usable file name ({getattr(e, 'strerror', None) or e})"
                                      ) from e
        if not inside:
            raise KimiCheckpointError(f"{self.index_file}: shard {_short(file_name)} escapes "
                                      f"{self.dir}")
        if size is None:
            raise KimiCheckpointError(f"{self.index_file}: shard {_short(file_name)} is missing")
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


class ExactExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, act_bits: int, device=None):
        super().__init__()
        self.gate_proj = PackedInt4Linear(hidden, inter, act_bits, device=device)
        self.up_proj = PackedInt4Linear(hidden, inter, act_bits, device=device)
        self.down_proj = PackedInt4Linear(inter, hidden, act_bits, device=device)


class ExactExperts(nn.Module):
    """transformers' fused DeepseekV3Experts (exactness.hf), exact, with the same call. Expert
    E's projections are `E.gate_proj`, `E.up_proj` and `E.down_proj`: the checkpoint's own
    names (`...mlp.experts.E.gate_proj.weight_packed`). A forward is one grouped call per
    projection (exactness.moe); `grouped = False` runs transformers' own loop instead
    (`per_expert`), the reference the grouped call is checked against."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act_fn,
                 act_bits: int = DEFAULT_ACT_BITS, device=None, grouped: bool = True):
        super().__init__()
        for e in range(num_experts):
            self.add_module(str(e), ExactExpert(hidden, inter, act_bits, device))
        self.num_experts, self.act_fn, self.grouped = num_experts, act_fn, grouped

    def __getitem__(self, e: int) -> ExactExpert:
        return getattr(self, str(e))

    def __len__(self) -> int:
        return self.num_experts

    def __iter__(self):
        return (self[e] for e in range(self.num_experts))

    @classmethod
    def like(cls, fused: nn.Module, act_bits: int = DEFAULT_ACT_BITS,
             device=None) -> ExactExperts:
        """The exact experts for transformers' fused module `fused` (its sizes, its act_fn)."""
        return cls(fused.num_experts, fused.hidden_dim, fused.intermediate_dim, fused.act_fn,
                   act_bits, device)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if not self.grouped:
            return self.per_expert(hidden_states, top_k_index, top_k_weights)
        return experts_forward(self, self.act_fn, hidden_states, top_k_index, top_k_weights,
                               hidden_states.dtype,
                               lambda: self.per_expert(hidden_states, top_k_index, top_k_weights))

    def per_expert(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' own loop (DeepseekV3Experts.forward) over the exact layers, expert by
        expert: ids in [0, E], E its padding for "no expert"."""
        ids = top_k_index.to(torch.int64)
        check_routing(ids, self.num_experts)
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(ids).tolist():
            if e == self.num_experts:
                continue
            token, slot = torch.where(ids == e)
            x, expert = hidden_states[token], self[e]
            y = expert.down_proj(activation(self.act_fn, expert.gate_proj(x), expert.up_proj(x)))
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` is transformers' fused routed experts (DeepseekV3Experts' shape)."""
    return (isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(module, "down_proj", None), torch.Tensor)
            and module.gate_up_proj.dim() == 3 and hasattr(module, "num_experts"))


# --------------------------------------------------------------------------- the converter


@dataclass
class ConversionReport:
    routed_converted: int = 0  # routed projections made exact here
    routed_loaded: int = 0
    dense_converted: int = 0
    left_bf16: list[str] = field(default_factory=list)
    remote_experts: list[str] = field(default_factory=list)  # held elsewhere (experts=)
    bytes_read: int = 0  # tensor bytes read from the shards
    peak_rss_growth: int = 0  # how much the process's peak resident memory grew meanwhile

    def summary(self) -> dict:
        return {"routed_converted": self.routed_converted, "routed_loaded": self.routed_loaded,
                "dense_converted": self.dense_converted, "left_bf16": len(self.left_bf16),
                "remote_experts": len(self.remote_experts), "bytes_read": self.bytes_read,
                "peak_rss_growth": self.peak_rss_growth}


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def expert_parallel(rank: int, world: int, n_experts: int) -> Callable[[int, int], bool]:
    """The routed experts rank `rank` of `world` holds, placed as vLLM's expert parallelism
    places them by default: a contiguous block each, the first `n_experts % world` ranks one
    more. A predicate on (layer, expert), for `experts=`."""
    for what, value, low in (("world", world, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise KimiConversionError(f"{what} must be an int >= {low}, got {_short(value)}")
    if rank >= world:
        raise KimiConversionError(f"rank {rank} is not below world {world}")
    base, extra = divmod(n_experts, world)
    start = rank * base + min(rank, extra)
    stop = start + base + (rank < extra)
    return lambda layer, expert: start <= expert < stop


def local_experts(experts, rank, world, n_experts: int):
    """`experts=` (a predicate on (layer, expert)), or the one `rank`/`world` make, or None: all
    of them."""
    if rank is None and world is None:
        if experts is not None and not callable(experts):
            raise KimiConversionError(f"experts= takes a predicate on (layer, expert), got "
                                      f"{_short(experts)}")
        return experts
    if experts is not None:
        raise KimiConversionError("experts= or rank= and world=, not both")
    if rank is None or world is None:
        raise KimiConversionError(f"rank= and world= go together, got rank={rank!r}, "
                                  f"world={world!r}")
    return expert_parallel(rank, world, n_experts)


def make_remote(targets: dict[str, PackedInt4Linear], local, parents: dict[str, nn.Module],
                replacements: dict[str, nn.Module]) -> list[str]:
    """Each routed projection in `targets` of an expert `local` does not take becomes a
    RemoteLinear (in its new parent from `parents`, else a replacement) and leaves `targets`.
    The experts held elsewhere, by name."""
    remote = set()
    for name in list(targets):
        m = ROUTED.match(name)
        if m is None:
            raise KimiConversionError(f"{name}: not named like a routed projection, so experts= "
                                      f"cannot tell which expert it is")
        if local(int(m[1]), int(m[2])):
            continue
        layer = targets.pop(name)
        stand_in = RemoteLinear(name, layer.in_features, layer.out_features)
        parent, _, child = name.rpartition(".")
        if parent in parents:
            setattr(parents[parent], child, stand_in)
        else:
            replacements[name] = stand_in
        remote.add(parent)
    return sorted(remote, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])


def convert_kimi_to_exact(model: nn.Module, checkpoint_dir: str | Path | None = None, *,
                          act_bits: int = DEFAULT_ACT_BITS, dense_bits: int | None = None,
                          experts: Callable[[int, int], bool] | None = None,
                          rank: int | None = None, world: int | None = None,
                          mmap: bool = False, device=None,
                          progress: bool | None = None) -> ConversionReport:
    """Make every routed-expert projection a `PackedInt4Linear` (loaded from the checkpoint when
    one is given), transformers' fused experts (DeepseekV3Experts) an `ExactExperts`; with
    dense_bits 4 or 8, shared experts and the dense MLP go through `ExactLinear.from_weight`.

    - All or nothing: every header is checked before the first tensor is read, each tensor is
      checked as it is read (streamed, shard by shard), and the model changes only once every
      tensor is in. A failure leaves it exactly as it was.
    - `experts=` (a predicate on (layer, expert)) or `rank=`/`world=` (expert_parallel) load
      only the experts this process serves; the others become RemoteLinear, listed in the
      report, and a token routed to one raises MissingExpertError.
    - `mmap=True`: the int4 tensors stay the shards' own pages, copy-on-write (CPU only).
    - `device`: where the tensors go, one at a time (default: the routed modules' device, the
      CPU for a model on meta).
    - `progress`: a bar (tqdm); None shows it on a terminal for a load over 1 GiB."""
    if dense_bits not in (None, 4, 8):
        raise ValueError(f"dense_bits must be None, 4 or 8, got {dense_bits!r}")
    import resource

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    checkpoint = KimiCheckpoint(checkpoint_dir) if checkpoint_dir is not None else None
    try:
        n_experts = checkpoint.config.n_routed_experts if checkpoint else _n_experts(model)
        local = local_experts(experts, rank, world, n_experts)
        report, targets, replacements, loaded = _stage(model, checkpoint, act_bits, dense_bits,
                                                       local, device, mmap, progress)
    finally:
        if checkpoint is not None:
            checkpoint.close()
    # The swap: every tensor is read and checked, so nothing below can fail.
    for name, state in loaded.items():
        install(targets[name], state)
    for name, new in replacements.items():
        replace_module(model, name, new)
    report.bytes_read = checkpoint.bytes_read if checkpoint else 0
    report.peak_rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    return report


def _n_experts(model: nn.Module) -> int:
    """The routed experts a layer of `model` has (for rank/world without a checkpoint)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", config)
    for key in ("n_routed_experts", "num_local_experts"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return 1 + max((int(m[2]) for name, _ in model.named_modules() if (m := ROUTED.match(name))),
                   default=-1)


def _stage(model: nn.Module, checkpoint: KimiCheckpoint | None, act_bits: int,
           dense_bits: int | None, local, device, mmap: bool, progress: bool | None):
    """Everything convert_kimi_to_exact does but change the model: the report; each routed
    projection's layer-to-be (the model's own when it is a PackedInt4Linear of these act_bits);
    the new modules to swap in; and each routed projection's tensors, checked and read."""
    report = ConversionReport()
    targets: dict[str, PackedInt4Linear] = {}  # routed projection -> the layer that will hold it
    replacements: dict[str, nn.Module] = {}
    parents: dict[str, nn.Module] = {}  # a new ExactExperts' experts, by their names-to-be
    fused = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    for name, module in fused:  # transformers' experts: one exact module, 3 layers an expert
        at = "meta" if checkpoint is not None else module.gate_up_proj.device  # (assigned)
        replacements[name] = ExactExperts.like(module, act_bits, at)
        register_experts(name, replacements[name], parents, targets)
    for name, module in model.named_modules():
        if ROUTED.match(name) and isinstance(module, nn.Linear | PackedInt4Linear):
            if isinstance(module, nn.Linear) and module.bias is not None:
                raise KimiConversionError(f"{name}: a routed nn.Linear with a bias: Kimi's int4 "
                                          f"experts have none, and converting would drop it")
            reuse = isinstance(module, PackedInt4Linear) and module.act_bits == act_bits
            targets[name] = module if reuse else PackedInt4Linear(
                module.in_features, module.out_features, act_bits=act_bits)
            if not reuse:
                replacements[name] = targets[name]
        elif SHARED_OR_DENSE.match(name) and isinstance(module, nn.Linear):
            if dense_bits is None:
                report.left_bf16.append(name)
            else:
                replacements[name] = ExactLinear.from_weight(module.weight.detach(), dense_bits,
                                                             act_bits=act_bits)
                report.dense_converted += 1
    if local is not None:
        report.remote_experts = make_remote(targets, local, parents, replacements)
    report.routed_converted = len(targets)
    loaded = {}
    if checkpoint is not None:
        listed = sum(len(names) for names in checkpoint.routed_experts().values())
        if listed and not targets and not report.remote_experts:
            raise KimiConversionError(
                f"no module of the model is named like a routed expert "
                f"([language_model.]model.layers.L.mlp.experts.E.gate_proj, ...), but the "
                f"checkpoint has {listed} of them: nothing would be converted (under a wrapper, "
                f"convert the module whose names start there)")
        loaded = load_routed(checkpoint, targets, device, mmap, progress)
        report.routed_loaded = len(loaded)
    return report, targets, replacements, loaded


def load_routed(checkpoint: KimiCheckpoint, targets: dict[str, PackedInt4Linear], device,
                mmap: bool, progress: bool | None) -> dict[str, dict[str, torch.Tensor]]:
    """{projection: its three tensors} for `targets` {the checkpoint's module name: the layer
    to hold them}: every header checked first, then streamed (KimiCheckpoint.stream), each
    tensor's values checked as it is read. `device` None: the first layer's (meta: the CPU)."""
    wanted, check = routed_reads(checkpoint, targets)
    if device is None:
        first = next(iter(targets.values()), None)
        device = first.weight_packed.device if first is not None else "cpu"
        device = "cpu" if torch.device(device).type == "meta" else device
    check_mmap_device(mmap, device)
    return by_projection(checkpoint.stream(wanted, device=device, mapped=mmap, check=check,
                                           progress=progress))


def routed_reads(checkpoint: KimiCheckpoint, targets: dict[str, PackedInt4Linear]):
    """What streaming `targets`' tensors takes ({the checkpoint's module name: the layer to hold
    them}), every header checked first: {(name, buffer): the checkpoint's name}, and the check
    of each one's values as it is read, check((name, buffer), tensor)."""
    for name, layer in targets.items():  # all header checks before the first byte is read
        checkpoint.check_packed(layer, name)
    wanted = {(name, key): checkpoint.name_for(name, key) for name in targets
              for key in PACKED_KEYS}

    def check(key, tensor):
        name, buffer = key
        checkpoint.check_values(targets[name], name, buffer, tensor)

    return wanted, check


def by_projection(tensors: dict) -> dict[str, dict[str, torch.Tensor]]:
    """{(name, buffer): tensor} as {name: {buffer: tensor}}."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for (name, buffer), tensor in tensors.items():
        grouped.setdefault(name, {})[buffer] = tensor
    return grouped


def check_mmap_device(mmap: bool, device) -> None:
    """mmap=True maps the shards into this process: the tensors stay on the CPU."""
    if mmap and torch.device(device).type != "cpu":
        raise KimiConversionError(f"mmap=True maps the shards into host memory: it loads onto "
                                  f"the CPU, not {device}")


def register_experts(name: str, experts: ExactExperts, parents: dict[str, nn.Module],
                     targets: dict[str, PackedInt4Linear]) -> None:
    """The new `experts`, to be named `name`: each expert into `parents` and each projection
    into `targets`, by the names they will have in the model."""
    for e, expert in enumerate(experts):
        parents[f"{name}.{e}"] = expert
        for proj in ("gate", "up", "down"):
            targets[f"{name}.{e}.{proj}_proj"] = getattr(expert, f"{proj}_proj")
