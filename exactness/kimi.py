"""Kimi K2 Thinking / K2.5: exact routed experts, the converter, and a reader of real shards.

- `KimiMLP`, `KimiMoE`, `KimiModel`: a faithful minimal MoE stack with Kimi's module names
  (`model.layers.L.mlp.experts.E.{gate,up,down}_proj`, shared experts, the layer-0 dense MLP,
  the sigmoid router with `e_score_correction_bias`). Routed experts are `PackedInt4Linear` when
  `config.use_exact_generators` is true; shared experts and the dense MLP stay `nn.Linear`.
- `KimiCheckpoint`: reads only the tensors asked for from the safetensors shards listed in
  `model.safetensors.index.json`, after checking the quantization config and each shard's header.
- `convert_kimi_to_exact`: swaps routed-expert projections for loaded `PackedInt4Linear`s (zero
  conversion of the int4 weights), all or nothing.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .contract import BFLOAT16, DEFAULT_ACT_BITS, ExactnessError
from .formats import check_finite, float_bits
from .modules import ExactLinear, PackedInt4Linear


class KimiCheckpointError(ExactnessError, ValueError):
    """A checkpoint that is not what Kimi's native int4 format promises; names file and tensor."""


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
    def from_json(cls, config: dict) -> KimiConfig:
        text = config.get("text_config", config)  # K2.5 nests the language model's config
        known = {k: text[k] for k in cls.__dataclass_fields__ if k in text}
        return cls(**known)


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
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


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
    def __init__(self, config: KimiConfig):
        super().__init__()
        self.config = config
        self.experts = nn.ModuleList(KimiMLP(config, config.moe_intermediate_size, routed=True)
                                     for _ in range(config.n_routed_experts))
        self.gate = KimiRouter(config)
        self.shared_experts = KimiMLP(config,
                                      config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights = self.gate(x)
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in torch.unique(chosen).tolist():  # each expert sees only its tokens
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            out.index_add_(0, token, weights[token, slot, None] * self.experts[e](x[token]).float())
        return (out + self.shared_experts(x).float()).to(x.dtype).reshape(shape)


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

ROUTED = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
                    r"(gate|up|down)_proj$")
SHARED_OR_DENSE = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.mlp\."
                             r"(?:shared_experts\.)?(gate|up|down)_proj$")
PACKED_KEYS = ("weight_packed", "weight_scale", "weight_shape")
MAX_HEADER = 100 * 2**20  # a safetensors header larger than this is refused, not allocated
EXPECTED_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32}


def check_quantization_config(config: dict, where: str) -> None:
    """Refuse anything but int4 symmetric group-32 pack-quantized compressed-tensors."""
    q = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config")
    if not q:
        raise KimiCheckpointError(f"{where}: no quantization_config (top level or text_config)")
    if q.get("quant_method") != "compressed-tensors":
        raise KimiCheckpointError(f"{where}: quant_method {q.get('quant_method')!r}, expected "
                                  f"'compressed-tensors'")
    groups = q.get("config_groups") or {}
    if not groups:
        raise KimiCheckpointError(f"{where}: quantization_config has no config_groups")
    for name, group in groups.items():
        fmt = group.get("format", q.get("format"))
        if fmt != "pack-quantized":
            raise KimiCheckpointError(f"{where}: config group {name!r} has format {fmt!r}, "
                                      f"expected 'pack-quantized'")
        weights = group.get("weights") or {}
        for key, want in EXPECTED_WEIGHTS.items():
            if weights.get(key) != want:
                raise KimiCheckpointError(f"{where}: config group {name!r} has weights.{key} = "
                                          f"{weights.get(key)!r}, expected {want!r}")


class KimiCheckpoint:
    """A checkpoint directory: config.json, model.safetensors.index.json and its shards."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        config_file = self.dir / "config.json"
        if not config_file.is_file():
            raise KimiCheckpointError(f"{config_file}: missing")
        self.raw_config = json.loads(config_file.read_text())
        check_quantization_config(self.raw_config, str(config_file))
        self.config = KimiConfig.from_json(self.raw_config)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(self._shard("model.safetensors"), framework="pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118
        else:
            raise KimiCheckpointError(f"{index}: missing (and no single model.safetensors)")
        self.bytes_read = 0
        self._open = {}
        self._checked: dict[str, torch.Tensor] = {}  # small tensors read ahead by check_packed

    def _shard(self, file_name: str) -> Path:
        path = (self.dir / file_name).resolve()
        if Path(file_name).is_absolute() or self.dir.resolve() not in path.parents:
            raise KimiCheckpointError(f"shard {file_name!r} in the index escapes {self.dir}")
        if not path.is_file():
            raise KimiCheckpointError(f"shard {file_name!r} listed in the index is missing")
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
        if len(head) < 8:
            raise KimiCheckpointError(f"{path}: truncated (no safetensors header)")
        header_len = struct.unpack("<Q", head)[0]
        if header_len > MAX_HEADER or header_len > size - 8:
            raise KimiCheckpointError(f"{path}: header claims {header_len} bytes, the file has "
                                      f"{size}: refusing the allocation")
        return path

    def name_for(self, module_name: str, key: str) -> str:
        """The checkpoint's name for a tensor, with or without the K2.5 prefix."""
        name = f"{module_name}.{key}"
        for candidate in (name, name.removeprefix("language_model."), f"language_model.{name}"):
            if candidate in self.weight_map:
                return candidate
        raise KimiCheckpointError(f"tensor {name!r} is not in the checkpoint's weight_map")

    def _handle(self, name: str):
        from safetensors import SafetensorError, safe_open

        file_name = self.weight_map[name]
        if file_name not in self._open:
            path = self._shard(file_name)
            try:
                self._open[file_name] = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as e:
                raise KimiCheckpointError(f"{path}: unreadable shard ({e})") from e
        return self._open[file_name]

    def check_packed(self, layer: PackedInt4Linear, module_name: str) -> None:
        """Everything `load_packed` would refuse, found before anything is loaded: presence,
        dtypes and shapes from the headers; scale finiteness and weight_shape from their (small)
        data. The packed words themselves are not read."""
        expected = layer._expected()
        for key, (shape, dtypes) in expected.items():
            name = self.name_for(module_name, key)
            where = f"{self.dir / self.weight_map[name]}: {module_name}: {key}"
            try:
                piece = self._handle(name).get_slice(name)
            except Exception as e:  # safetensors raises its own error type for a missing name
                raise KimiCheckpointError(f"{where}: not in the shard ({e})") from e
            dtype = getattr(torch, {"I32": "int32", "I64": "int64", "BF16": "bfloat16"}.get(
                piece.get_dtype(), "uint8"), None)
            if dtype not in dtypes:
                raise KimiCheckpointError(f"{where}: dtype {piece.get_dtype()}, expected one of "
                                          f"{dtypes}")
            if tuple(piece.get_shape()) != shape:
                raise KimiCheckpointError(f"{where}: shape {tuple(piece.get_shape())}, "
                                          f"expected {shape}")
        scale, shape = (self.read(self.name_for(module_name, k))
                        for k in ("weight_scale", "weight_shape"))
        self._checked.update({self.name_for(module_name, "weight_scale"): scale,
                              self.name_for(module_name, "weight_shape"): shape})
        try:
            check_finite(float_bits(scale), BFLOAT16, "weight_scale")
            if [int(v) for v in shape] != [layer.out_features, layer.in_features]:
                raise KimiCheckpointError(f"weight_shape: {[int(v) for v in shape]}, but the "
                                          f"layer is [{layer.out_features}, {layer.in_features}]")
        except ExactnessError as e:
            name = self.name_for(module_name, "weight_scale")
            raise KimiCheckpointError(f"{self.dir / self.weight_map[name]}: {module_name}: {e}"
                                      ) from e

    def read(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError

        if name in self._checked:  # read once, by check_packed
            return self._checked.pop(name)
        file_name = self.weight_map[name]
        handle = self._handle(name)
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise KimiCheckpointError(f"{self.dir / file_name}: tensor {name!r}: {e}") from e
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def load_packed(self, layer: PackedInt4Linear, module_name: str) -> None:
        """Load one projection's three tensors; errors name the tensor and the file."""
        names = {k: self.name_for(module_name, k) for k in PACKED_KEYS}
        state = {k: self.read(n) for k, n in names.items()}
        try:
            layer.load_state_dict(state)
        except ExactnessError as e:
            raise KimiCheckpointError(
                f"{self.dir / self.weight_map[names['weight_packed']]}: {module_name}: {e}") from e

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


# --------------------------------------------------------------------------- the converter


@dataclass
class ConversionReport:
    routed_converted: int = 0
    routed_loaded: int = 0
    dense_converted: int = 0
    left_bf16: list[str] = field(default_factory=list)
    bytes_read: int = 0  # tensor bytes read from the shards
    peak_rss_growth: int = 0  # how much the process's peak resident memory grew meanwhile

    def summary(self) -> dict:
        return {"routed_converted": self.routed_converted, "routed_loaded": self.routed_loaded,
                "dense_converted": self.dense_converted, "left_bf16": len(self.left_bf16),
                "bytes_read": self.bytes_read, "peak_rss_growth": self.peak_rss_growth}


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def convert_kimi_to_exact(model: nn.Module, checkpoint_dir: str | Path | None = None, *,
                          act_bits: int = DEFAULT_ACT_BITS,
                          dense_bits: int | None = None) -> ConversionReport:
    """Make every routed-expert projection a `PackedInt4Linear` (loaded from the checkpoint when
    one is given); with dense_bits 4 or 8, shared experts and the dense MLP go through
    `ExactLinear.from_weight`. All replacements are built first and swapped in together, so a
    failure leaves the model exactly as it was."""
    if dense_bits not in (None, 4, 8):
        raise ValueError(f"dense_bits must be None, 4 or 8, got {dense_bits!r}")
    import resource

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    checkpoint = KimiCheckpoint(checkpoint_dir) if checkpoint_dir is not None else None
    report = ConversionReport()
    targets: dict[str, PackedInt4Linear] = {}  # routed projection -> the layer that will hold it
    replacements: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if ROUTED.match(name) and isinstance(module, nn.Linear | PackedInt4Linear):
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
    report.routed_converted = len(targets)
    if checkpoint is not None:
        for name, layer in targets.items():  # all checks before the first byte is loaded
            checkpoint.check_packed(layer, name)
        for name, layer in targets.items():  # in place: no second copy of the experts
            checkpoint.load_packed(layer, name)
            report.routed_loaded += 1
    for name, new in replacements.items():
        _set(model, name, new)
    report.bytes_read = checkpoint.bytes_read if checkpoint else 0
    report.peak_rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    return report
