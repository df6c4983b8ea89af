"""convert_kimi_to_exact: routed projections swapped for loaded PackedInt4Linear layers, all or
nothing: every read and check comes before the swap."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..contract import DEFAULT_ACT_BITS
from ..glue import check_block
from ..modules import ExactLinear, PackedInt4Linear
from .checkpoint import PACKED_KEYS, ROUTED, SHARED_OR_DENSE, KimiCheckpoint, install
from .config import KimiConversionError
from .experts import ExactExperts, is_fused_experts
from .placement import local_experts, make_remote


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


def convert_kimi_to_exact(model: nn.Module, checkpoint_dir: str | Path | None = None, *,
                          act_bits: int = DEFAULT_ACT_BITS, dense_bits: int | None = None,
                          experts: Callable[[int, int], bool] | None = None,
                          rank: int | None = None, world: int | None = None,
                          mmap: bool = False, device=None, progress: bool | None = None,
                          block: str = "exact") -> ConversionReport:
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
    - `progress`: a bar (tqdm); None shows it on a terminal for a load over 1 GiB.
    - `block`: the glue of the new ExactExperts, "exact" (the default: one rounding of the
      whole block) or "transformers" (transformers' bits; docs/KIMI.md)."""
    if dense_bits not in (None, 4, 8):
        raise ValueError(f"dense_bits must be None, 4 or 8, got {dense_bits!r}")
    check_block(block)
    import resource

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    checkpoint = KimiCheckpoint(checkpoint_dir) if checkpoint_dir is not None else None
    try:
        n_experts = checkpoint.config.n_routed_experts if checkpoint else _n_experts(model)
        local = local_experts(experts, rank, world, n_experts)
        report, targets, replacements, loaded = _stage(model, checkpoint, act_bits, dense_bits,
                                                       local, device, mmap, progress, block)
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
           dense_bits: int | None, local, device, mmap: bool, progress: bool | None,
           block: str = "exact"):
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
        replacements[name] = ExactExperts.like(module, act_bits, at, block=block)
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
