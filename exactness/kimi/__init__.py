"""Kimi K2 Thinking / K2.5: exact routed experts, the converter, and a reader of real shards.

One job a file: config (config.json, the errors), model (the MoE stack), header (a shard's
safetensors header checked), checkpoint (KimiCheckpoint), experts (ExactExperts), placement
(expert parallelism), convert (convert_kimi_to_exact). Every name is importable from here.

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

from .checkpoint import (
    EXPECTED_WEIGHTS,
    LAYERS,
    PACKED_KEYS,
    ROUTED,
    SHARED_OR_DENSE,
    KimiCheckpoint,
    Shard,
    check_quantization_config,
    install,
    progress_bar,
)
from .config import (
    KimiCheckpointError,
    KimiConfig,
    KimiConversionError,
    brief,
    config_value,
    json_kind,
    json_object,
    read_json,
    shown_key,
)
from .convert import (
    ConversionReport,
    by_projection,
    check_mmap_device,
    convert_kimi_to_exact,
    load_routed,
    register_experts,
    replace_module,
    routed_reads,
)
from .experts import (
    ExactExpert,
    ExactExperts,
    is_fused_experts,
)
from .header import (
    DTYPE_BITS,
    MAX_HEADER,
    TORCH_DTYPES,
    TensorEntry,
    parse_safetensors_header,
)
from .model import (
    KimiDecoderLayer,
    KimiInner,
    KimiK25,
    KimiMLP,
    KimiModel,
    KimiMoE,
    KimiRouter,
)
from .placement import (
    expert_parallel,
    local_experts,
    make_remote,
)

__all__ = [
    "EXPECTED_WEIGHTS",
    "LAYERS",
    "PACKED_KEYS",
    "ROUTED",
    "SHARED_OR_DENSE",
    "KimiCheckpoint",
    "Shard",
    "check_quantization_config",
    "install",
    "progress_bar",
    "KimiCheckpointError",
    "KimiConfig",
    "KimiConversionError",
    "brief",
    "config_value",
    "json_kind",
    "json_object",
    "read_json",
    "shown_key",
    "ConversionReport",
    "by_projection",
    "check_mmap_device",
    "convert_kimi_to_exact",
    "load_routed",
    "register_experts",
    "replace_module",
    "routed_reads",
    "ExactExpert",
    "ExactExperts",
    "is_fused_experts",
    "DTYPE_BITS",
    "MAX_HEADER",
    "TORCH_DTYPES",
    "TensorEntry",
    "parse_safetensors_header",
    "KimiDecoderLayer",
    "KimiInner",
    "KimiK25",
    "KimiMLP",
    "KimiModel",
    "KimiMoE",
    "KimiRouter",
    "expert_parallel",
    "local_experts",
    "make_remote",
]
