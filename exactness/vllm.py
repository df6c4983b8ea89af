"""The vLLM plugin: Kimi K2 / K2.5's int4 routed experts served exactly inside vLLM.

vLLM loads it through the `vllm.general_plugins` entry point (`register`). It adds the
quantization method `exactness`, picked by `LLM(path, quantization="exactness")` or
`--quantization exactness`. The method takes Kimi's compressed-tensors config as it is (int4,
symmetric, group 32, pack-quantized) and refuses any other by name.

- Every routed-expert layer (vLLM's RoutedExperts) gets `ExactMoEMethod`. It holds vLLM's
  stacked tensors in the checkpoint's layout (exactness.stacked): the checkpoint's words and
  scales are copied in as they are, with no repacking and no dequantized copy. Each tensor is
  checked as it loads (dtype, shape, finite scales), and a tensor never loaded is an error
  naming it. `apply` is one custom op, `exactness::stacked_experts`: one grouped exact call per
  projection, with vLLM's top-k ids and weights.
- Every other layer stays vLLM's: attention, the router, the shared experts, the dense MLP and
  lm_head (bf16 in Kimi). A Linear the checkpoint quantizes is refused: only the routed experts
  are served here.
- vLLM's steps around the experts stay its own: the router's weights, the routed scaling
  factor, the add of the shared experts' output and the tensor-parallel all-reduce, each in
  the model's dtype (docs/VLLM.md).

EXACTNESS_BLOCK picks the glue between the projections ("exact", the default, or
"transformers"), EXACTNESS_ACT_BITS the activations' width (16, the default; 8 or 32).
"""

from __future__ import annotations

import functools
import os

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)
from vllm.model_executor.utils import set_weight_attrs

from . import stacked
from .contract import (
    DEFAULT_ACT_BITS,
    GROUP_SIZE,
    ContractTypeError,
    ContractValueError,
    ExactnessError,
    ShapeError,
    check_act_bits,
)
from .formats import check_finite_tensor
from .glue import check_block
from .kimi.checkpoint import check_quantization_config
from .kimi.config import KimiCheckpointError

NAME = "exactness"
BLOCK_ENV, ACT_BITS_ENV = "EXACTNESS_BLOCK", "EXACTNESS_ACT_BITS"
SHARDS = {"w1": "gate", "w3": "up", "w2": "down"}  # vLLM's shard ids: the checkpoint's names
KEYS = ("weight_packed", "weight_scale", "weight_shape")
PARAMS = {"w13_packed": "w13_weight_packed", "w13_scale": "w13_weight_scale",  # stacked's key:
          "w2_packed": "w2_weight_packed", "w2_scale": "w2_weight_scale"}  # vLLM's parameter


class RefusedConfigError(ExactnessError, RuntimeError):
    """A quantization_config the plugin cannot serve exactly (other bits, asymmetric, other
    groups). Not a ValueError: vLLM checks its config with pydantic, which would wrap one and
    drop its type."""


def register() -> None:
    """The entry point (vllm.general_plugins): the `exactness` quantization method."""
    register_quantization_config(NAME)(ExactnessConfig)


def settings() -> tuple[str, int]:
    """(block, act_bits) from EXACTNESS_BLOCK and EXACTNESS_ACT_BITS, checked."""
    block = check_block(os.environ.get(BLOCK_ENV) or "exact")
    raw = os.environ.get(ACT_BITS_ENV) or str(DEFAULT_ACT_BITS)
    try:
        act_bits = int(raw)
    except ValueError:
        raise ContractValueError(f"{ACT_BITS_ENV}={raw!r}: expected 8, 16 or 32") from None
    check_act_bits(act_bits)
    return block, act_bits


class ExactnessConfig(CompressedTensorsConfig):
    """Kimi's compressed-tensors config, its routed experts exact (the module's doc)."""

    def get_name(self) -> str:
        return NAME

    @classmethod
    def from_config(cls, config: dict) -> ExactnessConfig:
        check_quantization_config({"quantization_config": config}, "config.json")
        made = super().from_config(dict(config))
        made.block, made.act_bits = settings()
        return made

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        """`exactness` where the user asks for it, and the checkpoint is one it serves exactly
        (else RefusedConfigError says which field is not); never chosen unasked."""
        if user_quant != NAME:
            return None
        try:
            check_quantization_config({"quantization_config": hf_quant_cfg}, "config.json")
        except KimiCheckpointError as e:
            raise RefusedConfigError(f"{e}: exactness serves only Kimi's int4 format "
                                     f"exactly, and serves nothing lossy") from None
        return NAME

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, RoutedExperts):
            self._add_fused_moe_to_target_scheme_map()
            names = [f"{prefix}.0.{p}" for p in (layer.ckpt_gate_proj_name,
                                                  layer.ckpt_up_proj_name,
                                                  layer.ckpt_down_proj_name)]
            if all(self.get_scheme_dict(layer, n) is None for n in names):
                return UnquantizedFusedMoEMethod(layer.moe_config)  # bf16 experts: vLLM's
            return ExactMoEMethod(layer.moe_config, self.act_bits, self.block)
        method = super().get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase) and not isinstance(method, UnquantizedLinearMethod):
            raise KimiCheckpointError(
                f"{prefix}: quantized in the checkpoint, but exactness serves only the routed "
                f"experts int4 (Kimi keeps every other layer bf16): list it in "
                f"quantization_config.ignore, or serve without --quantization {NAME}")
        return method


class ExactMoEMethod(FusedMoEMethodBase):
    """A routed-expert layer's method: the checkpoint's int4 experts held stacked as vLLM loads
    them (exactness.stacked), each tensor checked as it loads, and one exact custom op a
    forward."""

    def __init__(self, moe, act_bits: int = DEFAULT_ACT_BITS, block: str = "exact"):
        super().__init__(moe)
        self.act_bits, self.block = act_bits, check_block(block)

    def create_weights(self, layer, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs):
        inter = intermediate_size_per_partition
        for what, size in (("hidden_size", hidden_size), ("the intermediate size per rank",
                                                           inter)):
            if size % GROUP_SIZE:
                raise ShapeError(f"{layer.layer_name}: {what} is {size}, not a multiple of "
                                 f"{GROUP_SIZE} (a whole number of scale groups): pick a "
                                 f"tensor-parallel size that divides it so")
        loader = extra_weight_attrs.pop("weight_loader")
        extra_weight_attrs.pop("global_num_experts", None)
        extra_weight_attrs.pop("unpadded_hidden_size", None)
        attrs = {**extra_weight_attrs, "is_transposed": False, "quant_method": "group",
                 "weight_loader": functools.partial(self._load, layer, loader)}
        shapes = stacked.stacked_shapes(num_experts, hidden_size, inter)
        for key, name in PARAMS.items():  # in the format's dtypes, whatever the model's
            param = torch.nn.Parameter(torch.empty(shapes[key], dtype=stacked.stacked_dtype(key)),
                                       requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, attrs)
        for name in ("w13_weight_shape", "w2_weight_shape"):
            param = torch.nn.Parameter(torch.zeros(num_experts, 2, dtype=torch.int64),
                                       requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, attrs)
        layer.exactness_loaded = set()  # (global expert, shard, key) loaded so far

    def _load(self, layer, loader, param, loaded_weight: torch.Tensor, weight_name: str,
              shard_id: str, expert_id: int, return_success: bool = False):
        """vLLM's loader, after checking the checkpoint's tensor (its name in the errors)."""
        key = next((k for k in KEYS if weight_name.endswith(k)), None)
        if key is None or shard_id not in SHARDS:
            raise KimiCheckpointError(f"{layer.layer_name}: {weight_name!r} ({shard_id}): not "
                                      f"a tensor of an int4 expert ({', '.join(KEYS)})")
        if layer.expert_map_manager.map_global_to_local(expert_id) == -1:
            return loader(param, loaded_weight, weight_name, shard_id, expert_id,
                          return_success=return_success)  # another rank's expert
        proj = getattr(layer, f"ckpt_{SHARDS[shard_id]}_proj_name")
        name = f"{layer.layer_name}.{expert_id}.{proj}.{key}"
        check_tensor(name, key, loaded_weight, shard_id, layer.hidden_size,
                     layer.intermediate_size_per_partition * layer.moe_config.tp_size)
        done = loader(param, loaded_weight, weight_name, shard_id, expert_id,
                      return_success=return_success)
        layer.exactness_loaded.add((expert_id, shard_id, key))
        return done

    def process_weights_after_loading(self, layer) -> None:
        """Every local expert's every tensor loaded, or KimiCheckpointError naming the first
        missing; then the exact experts' views built once, ahead of the first forward."""
        expert_map = layer.expert_map
        local = (range(layer.global_num_experts) if expert_map is None else
                 [e for e in range(layer.global_num_experts) if int(expert_map[e]) >= 0])
        missing = [f"{layer.layer_name}.{e}.{getattr(layer, f'ckpt_{SHARDS[s]}_proj_name')}"
                   f".{k}" for e in local for s in SHARDS for k in KEYS
                   if (e, s, k) not in layer.exactness_loaded]
        if missing:
            raise KimiCheckpointError(f"{missing[0]}: missing from the checkpoint"
                                      + (f" (and {len(missing) - 1} more)"
                                         if len(missing) > 1 else ""))
        stacked.experts_of(layer.layer_name, stacked_tensors(layer), self.act_bits, self.block)

    def get_fused_moe_quant_config(self, layer):
        return None  # no vLLM kernel runs these experts

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        ids = topk_ids
        if layer.expert_map is not None:  # expert parallelism: another rank's expert is E
            local = layer.expert_map[ids.long()]
            ids = torch.where(local >= 0, local, layer.local_num_experts)
        t = stacked_tensors(layer)
        return torch.ops.exactness.stacked_experts(
            x, ids, topk_weights, t["w13_packed"], t["w13_scale"], t["w2_packed"],
            t["w2_scale"], self.act_bits, self.block, layer.layer_name)


def stacked_tensors(layer) -> dict[str, torch.Tensor]:
    return {key: getattr(layer, name) for key, name in PARAMS.items()}


def check_tensor(name: str, key: str, t: torch.Tensor, shard_id: str, hidden: int,
                 inter: int) -> None:
    """One expert's checkpoint tensor as this method loads it (the whole, before vLLM takes its
    rank's slice), or a typed error naming it."""
    n, k = (hidden, inter) if shard_id == "w2" else (inter, hidden)
    want = {"weight_packed": ((n, k // 8), (torch.int32,)),
            "weight_scale": ((n, k // GROUP_SIZE), (torch.bfloat16,)),
            "weight_shape": ((2,), (torch.int32, torch.int64))}[key]
    if t.dtype not in want[1]:
        raise ContractTypeError(f"{name}: dtype {t.dtype}, expected {want[1][0]}")
    if tuple(t.shape) != want[0]:
        raise ShapeError(f"{name}: shape {tuple(t.shape)}, expected {want[0]} (a group of "
                         f"{GROUP_SIZE} per scale)")
    if key == "weight_scale":
        check_finite_tensor(t, name)
    if key == "weight_shape" and [int(v) for v in t.tolist()] != [n, k]:
        raise ShapeError(f"{name}: {t.tolist()}, expected [{n}, {k}]")
