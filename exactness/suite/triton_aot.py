"""The Triton kernels compiled ahead of time for NVIDIA GPUs, on a machine without one.

The suite runs the kernels under the interpreter, which executes them with numpy's typing, not
the compiler's: an int64 constant, a shift or a dot that the compiler types or lowers differently
would pass there and break on a GPU. So every configuration the layer launches is compiled here
for real targets down to PTX and cubin (Triton's bundled ptxas), and each int8 dot must lower to
an integer tensor-core MMA (`mma.sync ... .s32.s8.s8.s32`, or on sm_90 from 64-row tiles on
`wgmma ... .s32.s8.s8`). A compile error, or a group kernel without that MMA, is a failure;
registers and spills are reported from ptxas, and the SASS instructions of each kernel's hot
loop are counted (cuobjdump). `--tiles` compiles the tiles bench/gpu_check.py times instead of
the layer's launches; `--aligned` compiles them as launched at Kimi's shapes, where Triton
specializes on 16-divisible arguments (the counts docs/PERFORMANCE.md gives).

The interpreter replaces the kernels, so this runs in a process without TRITON_INTERPRET:
    python -m exactness.suite.triton_aot [--arch 80 90] [--quick | --tiles] [--aligned] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

from .. import dataflow
from ..contract import FORMATS
from ..kernels.triton import folded as triton_folded
from ..kernels.triton import group as triton_group
from ..kernels.triton import grouped as triton_grouped
from ..kernels.triton import launch as triton_launch
from ..kernels.triton import quantize as triton_quantize
from ..kernels.triton import scales as triton_scales
from ..kernels.triton import wide as triton_wide

ARCHS = (80, 90)  # A100, H100/H200
# an int8 x int8 -> int32 tensor-core MMA: mma.sync (sm_80 on), or Hopper's warpgroup wgmma,
# which Triton takes on sm_90 for tiles of 64 rows and more
INT_MMA = re.compile(r"(?:mma\.sync|wgmma\.mma_async\.sync)\.aligned\.\S*\.s32\.s8\.s8(?:\.s32)?")
MMA_SHAPE = re.compile(r"m\d+n\d+k\d+")
PTXAS_USAGE = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class Compiled:
    kernel: str
    config: str
    arch: int
    ok: bool
    error: str = ""
    int_mma: list[str] = field(default_factory=list)
    shared_bytes: int = 0
    registers: int = -1
    spill_bytes: int = -1
    loop_instructions: int = -1  # SASS instructions in the kernel's hot loop, per warp and step
    per_element: float = -1.0  # the same per thread and element of a step (output, weight, x)

    def issue_share(self) -> str:
        return f"{self.per_element:.1f}" if self.per_element >= 0 else "-"


def _argument_types(kernel: str, width: int, z: str = "*i32") -> dict:
    """The launchers' runtime arguments (triton_quantize.quantize / linear) as Triton types."""
    if kernel == "quantize_kernel":
        return dict(x_ptr=f"*i{width}", a_ptr="*i8", e_ptr="*i64", nonfinite_ptr="*i8",
                    M="i32", K="i32", slice_k="i32", stride_xm="i32", stride_limb="i32")
    if kernel == "fold_kernel":
        return dict(w_ptr="*i32", f_ptr="*i32", folded_ptr="*i8", N="i32", K="i32",
                    stride_wn="i32", stride_fn="i32")
    if kernel == "combine_kernel":  # z: the int32 limb GEMMs, or a split launch's int64 T
        return dict(z_ptr=z, sum_ptr="*i64", e_ptr="*i64", emin_ptr="*i64",
                    y_ptr=f"*i{width}", M="i32", N="i32", stride_zm="i32", stride_ym="i32")
    if kernel in ("grouped_kernel", "grouped_finish_kernel"):  # triton_grouped.grouped_launch
        return dict(a_ptr="*i8", e_ptr="*i64", bad_ptr="*i8", source_ptr="*i64",
                    block_rows_ptr="*i64", block_expert_ptr="*i64", used_ptr="*i64",
                    table_ptr="*i64", y_ptr=f"*i{width}", slow_ptr="*i8", rows_total="i32",
                    N="i32", K="i32", stride_limb="i32", stride_am="i32", stride_ym="i32")
    if kernel == "scales_kernel":  # triton_scales.device_certificate
        return dict(s_ptr="*i16", w_ptr="*i32", f_ptr="*i32", r_ptr="*i64", emin_ptr="*i64",
                    flags_ptr="*i8", N="i32", G="i32", stride_wn="i32")
    if kernel == "finish_kernel":  # triton_wide.finish
        return dict(a_ptr="*i8", e_ptr="*i64", bad_ptr="*i8", w_ptr="*i32", s_ptr="*i16",
                    flags_ptr="*i8", y_ptr=f"*i{width}", M="i32", N="i32",
                    G="i32", stride_limb="i32", stride_am="i32", stride_wn="i32",
                    stride_ym="i32")
    return dict(a_ptr="*i8", w_ptr="*i32", f_ptr="*i32", r_ptr="*i64", e_ptr="*i64",
                emin_ptr="*i64", y_ptr=f"*i{width}", t_ptr="*i64", M="i32", N="i32", G="i32",
                groups_per_slice="i32", stride_limb="i32", stride_am="i32", stride_wn="i32",
                stride_fn="i32", stride_ym="i32")


def kernels() -> dict:
    """Every Triton kernel this tool compiles, by name (Triton must be installed)."""
    return {"quantize_kernel": triton_quantize.quantize_kernel,
            "exact_group_kernel": triton_group.exact_group_kernel,
            "fold_kernel": triton_folded.fold_kernel,
            "combine_kernel": triton_folded.combine_kernel,
            "grouped_kernel": triton_grouped.grouped_kernel,
            "scales_kernel": triton_scales.scales_kernel,
            "finish_kernel": triton_wide.finish_kernel,
            "grouped_finish_kernel": triton_grouped.grouped_finish_kernel}


def configurations(quick: bool = False) -> list[tuple[str, str, dict, dict]]:
    """(kernel, description, argument types, constants) for every launch the layer makes;
    `quick`: the Kimi case (bf16, 16-bit activations, 4-bit weights), and one limb unsplit."""
    formats = [FORMATS["bfloat16"]] if quick else list(FORMATS.values())
    configs = []
    for fmt in formats:
        for act_bits in (16,) if quick else (4, 8, 16, 32):
            for rows in (1, 16):  # quantize_tile's tiles from one row to BLOCK_M (the same code)
                tile = triton_quantize.quantize_tile(
                    rows, triton_quantize.quant_tile(act_bits, triton_quantize.GPU_QUANT_TILE))
                configs.append(("quantize_kernel", f"x {fmt.name}, act_bits {act_bits}, "
                                f"{tile[0]} x {tile[1]}",
                                _argument_types("quantize_kernel", fmt.width),
                                triton_quantize.quantize_constants(fmt, act_bits, *tile)))
    for w_bits in (4,) if quick else (4, 8):
        for limbs in (1, 2) if quick else (1, 2, 4):
            for out in formats:
                for split in (False, True) if limbs == 2 or not quick else (False,):
                    configs.append(("exact_group_kernel",
                                    f"w_bits {w_bits}, {limbs} limb(s), "
                                    f"out {out.name}{', split K' * split}",
                                    _argument_types("exact_group_kernel", out.width),
                                    triton_group.group_constants(w_bits, limbs, out,
                                                                 triton_group.GPU_BLOCK_N,
                                                                 split=split)))
    for out in formats:  # the split launches' rounding
        configs.append(("combine_kernel", f"split K: T int64, out {out.name}",
                        _argument_types("combine_kernel", out.width, z="*i64"),
                        triton_folded.combine_constants(
                            1, 1, out, triton_folded.GPU_COMBINE_BLOCK)))
    # the certificate on the device, and the finishing launch (slow rows, NaN outputs)
    for w_bits in (4,) if quick else (4, 8):
        for act_bits in (16,) if quick else (4, 8, 16, 32):
            configs.append(("scales_kernel", f"w_bits {w_bits}, act_bits {act_bits}",
                            _argument_types("scales_kernel", 32),
                            triton_scales.scales_constants(w_bits, 7168, act_bits)))
        for limbs in (2,) if quick else (1, 2, 4):
            for out in formats:
                configs.append(("finish_kernel", f"w_bits {w_bits}, {limbs} limb(s), "
                                f"out {out.name}", _argument_types("finish_kernel", out.width),
                                triton_wide.finish_constants(
                                    w_bits, limbs, 7168, {1: 8, 2: 16, 4: 32}[limbs], out)))
    # linear_folded's kernels, at every digit count the certificate allows (quick: the Kimi case,
    # two digits for spreads up to 3, 16-bit activations)
    most = max(dataflow.folded_weight_limbs(b, dataflow.max_folded_spread(b)) for b in (4, 8))
    digits = (2,) if quick else range(1, most + 1)
    for w_bits in (4,) if quick else (4, 8):
        for w_limbs in digits:
            configs.append(("fold_kernel", f"w_bits {w_bits}, {w_limbs} digits",
                            _argument_types("fold_kernel", 32),
                            triton_folded.fold_constants(w_bits, w_limbs, *triton_folded.GPU_FOLD)))
    for a_limbs in (2,) if quick else (1, 2):
        for w_limbs in digits:
            for out in formats:
                configs.append(("combine_kernel", f"{a_limbs} x {w_limbs} limbs, out {out.name}",
                                _argument_types("combine_kernel", out.width),
                                triton_folded.combine_constants(
                                    a_limbs, w_limbs, out, triton_folded.GPU_COMBINE_BLOCK)))
    # the grouped MoE kernel and its slow rows' launch: gate and up (two parts, rows gathered by
    # token), down (one part)
    grouped = (("grouped_kernel", triton_grouped.grouped_constants),
               ("grouped_finish_kernel", triton_grouped.grouped_finish_constants))
    for w_bits in (4,) if quick else (4, 8):
        for act_bits in (16,) if quick else (8, 16, 32):
            for out in formats:
                for (parts, gather), (name, constants) in itertools.product(
                        ((2, True), (1, False)), grouped):
                    configs.append((name, f"w_bits {w_bits}, act_bits {act_bits}, "
                                    f"out {out.name}, {parts} part(s)"
                                    f"{', gathered' if gather else ''}",
                                    _argument_types(name, out.width),
                                    constants(w_bits, act_bits, 7168 if parts == 2 else 2048, out,
                                              parts, gather, triton_launch.BLOCK_M,
                                              triton_group.GPU_BLOCK_N)))
    return configs


def record_key(tool, arch: int, data: bytes) -> str:
    """What a record depends on: the tool (its path and version: Triton's NvidiaTool), the
    architecture and the PTX or cubin bytes."""
    return hashlib.sha256(b"\0".join([str(tool).encode(), str(arch).encode(), data])).hexdigest()


def _remembered(tool, arch: int, data: bytes, compute):
    """compute(), a JSON value of one PTX or cubin by one of the CUDA tools, kept in the kernels'
    cache keyed by the tool, its version and the bytes: ptxas and cuobjdump take about 0.2 and
    0.6 s a kernel, and a warm run asked the same of them every time."""
    from ..kernels.toolchain import cache_dir

    cache, _ = cache_dir()
    if cache is None:
        return compute()
    file = cache / f"triton-aot-{record_key(tool, arch, data)[:24]}.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(file.read_text())
    value = compute()
    with contextlib.suppress(OSError):  # written whole or not at all
        part = file.with_name(f"{file.name}.{os.getpid()}.part")
        part.write_text(json.dumps(value))
        os.replace(part, file)
    return value


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes) that ptxas reports for the PTX; (-1, -1) if it does not say."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch)
    suffix = "a" if arch >= 90 else ""

    def usage() -> list[int]:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            proc = subprocess.run([ptxas.path, "-v", f"--gpu-name=sm_{arch}{suffix}", path,
                                   "-o", os.path.join(tmp, "kernel.cubin")],
                                  capture_output=True, text=True, timeout=120)
        used, spills = PTXAS_USAGE.search(proc.stderr), PTXAS_SPILLS.search(proc.stderr)
        return [int(used.group(1)) if used else -1,
                int(spills.group(1)) + int(spills.group(2)) if spills else -1]

    registers, spill_bytes = _remembered(ptxas, arch, ptx.encode(), usage)
    return registers, spill_bytes


SASS_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def hot_loop(cubin: bytes, arch: int) -> list[str]:
    """The opcodes of the cubin's longest loop (its longest backward branch), from cuobjdump:
    what one warp issues per step of a kernel's main loop. [] if there is none or no tool."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch)
    tool = os.path.join(os.path.dirname(ptxas.path), "cuobjdump")

    def loop() -> list[str]:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                                  timeout=120).stdout
        lines = [(int(m.group(1), 16), m.group(3), m.group(4))
                 for m in SASS_LINE.finditer(sass)]
        loops = [(target, at) for at, op, rest in lines if op.startswith("BRA")
                 for target in [int(t, 16) for t in re.findall(r"0x([0-9a-f]+)", rest)]
                 if target < at]
        if not loops:
            return []
        start, end = max(loops, key=lambda loop: loop[1] - loop[0])
        return [op for at, op, _ in lines if start <= at <= end]

    try:
        return _remembered((tool, ptxas), arch, cubin, loop)
    except OSError:  # no cuobjdump beside ptxas
        return []


def compile_kernel(fn, types: dict, constants: dict, arch: int, name: str = "",
                   config: str = "", needs_int_mma: bool = False, num_warps: int = 4,
                   aligned: bool = False) -> Compiled:
    """`fn` (a @triton.jit function) compiled for sm_`arch`; never raises for a bad kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name = name or fn.__name__
    record = Compiled(name, config, arch, ok=False)
    if not hasattr(fn, "cache_key"):  # an InterpretedFunction
        record.error = "TRITON_INTERPRET is set: the kernels are interpreted, not compiled"
        return record
    signature = {arg: "constexpr" if arg in constants else types[arg] for arg in fn.arg_names}
    # aligned: as a launch at Kimi's shapes, where Triton specializes the pointers and the
    # arguments divisible by 16 (every K, N, G, slice of K and stride there; not M), and
    # vectorizes on it
    attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in signature
             if aligned and signature[arg] != "constexpr"
             and (signature[arg].startswith("*") or arg in ("K", "N", "G", "slice_k")
                  or arg.startswith("stride_"))}
    source = ASTSource(fn, signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
                       attrs=attrs)
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": num_warps})
    except Exception as error:  # noqa: BLE001 - any compiler error is this kernel's verdict
        record.error = f"{type(error).__name__}: {str(error).strip()[-1500:]}"
        return record
    ptx = kernel.asm["ptx"]
    record.int_mma = sorted(set(INT_MMA.findall(ptx)))
    record.shared_bytes = kernel.metadata.shared
    record.registers, record.spill_bytes = _ptxas_usage(ptx, arch)
    record.loop_instructions = len(hot_loop(kernel.asm["cubin"], arch))
    # elements of one loop step, the product of the kernel's tile sides: outputs (a group of 32
    # each: BLOCK_M x BLOCK_N), weights (BLOCK_N x BLOCK_K) or activations (BLOCK_M x BLOCK_K)
    step = math.prod(v for k, v in constants.items() if k.startswith("BLOCK_"))
    if record.loop_instructions > 0:
        record.per_element = record.loop_instructions * 32 * num_warps / step
    record.ok = bool(record.int_mma) or not needs_int_mma
    if not record.ok:
        record.error = "its int8 dots do not lower to an integer tensor-core MMA"
    return record


def tuning_configurations() -> list[tuple[str, str, dict, dict, int]]:
    """The group kernel at triton_group.TUNING_TILES (bf16 out, 4-bit weights, two limbs: the
    Kimi case), as configurations plus num_warps."""
    bf16 = FORMATS["bfloat16"]
    return [("exact_group_kernel", f"{bm} x {bn}, {warps} warps",
             _argument_types("exact_group_kernel", bf16.width),
             triton_group.group_constants(4, 2, bf16, bn, bm), warps)
            for bm, bn, warps in triton_group.TUNING_TILES]


def compile_all(archs=ARCHS, quick: bool = False, tiles: bool = False,
                aligned: bool = False) -> list[Compiled]:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences 3.9's notice; no floats
    configs = (tuning_configurations() if tiles
               else [(*c, 4) for c in configurations(quick)])
    records, by_name = [], kernels()
    for arch in archs:
        for kernel, config, types, constants, warps in configs:
            records.append(compile_kernel(by_name[kernel], types, constants, arch,
                                          kernel, config,
                                          kernel in ("exact_group_kernel", "grouped_kernel"),
                                          warps, aligned))
    return records


def mma_name(instruction: str) -> str:
    """An MMA instruction in brief: its shape, and `wgmma` for the warpgroup one."""
    shape = MMA_SHAPE.search(instruction)
    kind = "wgmma " if instruction.startswith("wgmma") else ""
    return kind + (shape.group(0) if shape else "?")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactness.suite.triton_aot",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS),
                        help="compute capabilities (80: A100, 90: H100/H200)")
    parser.add_argument("--quick", action="store_true",
                        help="bf16, act_bits 16 (and one limb unsplit), int4 only")
    parser.add_argument("--json", action="store_true", help="the records as JSON on stdout")
    parser.add_argument("--aligned", action="store_true",
                        help="specialized as a launch at Kimi's shapes (16-divisible pointers, "
                             "K, N, G, strides): the code whose loops docs/PERFORMANCE.md counts")
    parser.add_argument("--tiles", action="store_true",
                        help="instead: the group kernel at the tiles bench/gpu_check.py times")
    args = parser.parse_args(argv)
    if not triton_launch.available():
        print("triton is not installed", file=sys.stderr)
        return 2
    records = compile_all(args.arch, args.quick, args.tiles, args.aligned)
    if args.json:
        print(json.dumps([asdict(r) for r in records]))
    else:
        print("| kernel | configuration | sm | verdict | int MMA | registers | spill bytes |"
              " shared bytes | hot loop (SASS per warp and step) | per thread and element |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in records:
            verdict = "compiled" if r.ok else f"FAILED: {r.error}"
            print(f"| {r.kernel} | {r.config} | {r.arch} | {verdict} | "
                  f"{', '.join(mma_name(m) for m in r.int_mma) or '-'} | {r.registers} | "
                  f"{r.spill_bytes} | {r.shared_bytes} | {max(r.loop_instructions, 0) or '-'} | "
                  f"{r.issue_share()} |")
    return 0 if records and all(r.ok for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
