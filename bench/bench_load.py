"""Loading a Kimi checkpoint at its real expert sizes: one MoE layer of E routed experts
(hidden 7168, expert width 2048, int4 group 32) in 4 shards, which this script writes.

Each load runs in a fresh process, with the page cache warm (the files are synced and read once
first), five times, the loads in turn: the median by time is shown.
Peak anonymous growth is the largest RssAnon seen during the load (sampled every millisecond)
less RssAnon before it, over the bytes loaded; VmHWM growth counts the mapped file pages too.

    .venv/bin/python -m bench.bench_load [--experts 32 128] [--dir /tmp/exactness-load]

Loads, side by side:
- `clone`: safetensors' safe_open, get_tensor and clone for every tensor (the floor to beat);
- `convert`: kimi.convert_kimi_to_exact on a KimiModel built on meta (the routed experts);
- `convert mmap`: the same with mmap=True (file-backed, copy-on-write);
- `from_pretrained`: hf.from_pretrained, every tensor of transformers' model;
- `from_pretrained mmap`: the same with mmap=True.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from exactness.kimi import EXPECTED_WEIGHTS

HIDDEN, INTER, SHARDS, REPEATS = 7168, 2048, 4, 5
MODES = ("clone", "convert", "convert mmap", "from_pretrained", "from_pretrained mmap")


def config(experts: int) -> dict:
    """A kimi_k2 config.json: one MoE layer (layer 0), small attention and vocabulary."""
    return {"model_type": "kimi_k2", "hidden_size": HIDDEN, "moe_intermediate_size": INTER,
            "intermediate_size": 4 * INTER, "n_routed_experts": experts,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 0,
            "num_hidden_layers": 1, "vocab_size": 256, "num_attention_heads": 1,
            "num_key_value_heads": 1, "q_lora_rank": 64, "kv_lora_rank": 64,
            "qk_rope_head_dim": 64, "v_head_dim": 64, "qk_nope_head_dim": 64, "n_group": 1,
            "topk_group": 1, "max_position_embeddings": 128, "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
                "group_0": {"format": "pack-quantized", "weights": dict(EXPECTED_WEIGHTS)}}}}


def write(directory: Path, experts: int) -> Path:
    """The checkpoint: random packed words, scales over two binades, the rest random bf16."""
    from transformers import DeepseekV3ForCausalLM

    from exactness.hf import text_config
    from tests.shards import write_shards

    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for e in range(experts):
        for proj, (n, k) in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)),
                             ("down", (HIDDEN, INTER))):
            name = f"model.layers.0.mlp.experts.{e}.{proj}_proj"
            tensors[f"{name}.weight_packed"] = torch.randint(-2**31, 2**31, (n, k // 8),
                                                             dtype=torch.int32, generator=g)
            tensors[f"{name}.weight_scale"] = (0x3C00 + torch.randint(
                0, 256, (n, k // 32), generator=g)).to(torch.int16).view(torch.bfloat16)
            tensors[f"{name}.weight_shape"] = torch.tensor([n, k])
    cfg = config(experts)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(text_config(cfg, "bench"))
    for name, t in model.state_dict().items():
        if ".mlp.experts." not in name:
            tensors[name] = (torch.randn(t.shape, generator=g) * 0.02).bfloat16()
    write_shards(directory, tensors, SHARDS)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def status(key: str) -> int:
    """A line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class AnonPeak(threading.Thread):
    """The largest RssAnon seen while it runs, sampled every millisecond."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = status("RssAnon"), threading.Event()

    def run(self):
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, status("RssAnon"))

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()
        self.peak = max(self.peak, status("RssAnon"))


def child(mode: str, directory: Path) -> dict:
    """One load in this process: seconds, bytes loaded, peak anonymous and VmHWM growth."""
    from safetensors import safe_open

    from exactness import hf
    from exactness.kimi import KimiCheckpoint, KimiConfig, KimiModel, convert_kimi_to_exact

    checkpoint = KimiCheckpoint(directory)
    model = None
    if mode.startswith("convert"):
        with torch.device("meta"):
            model = KimiModel(KimiConfig(**{k: v for k, v in checkpoint.raw_config.items()
                                            if k in KimiConfig.__dataclass_fields__}))
    anon0, hwm0 = status("RssAnon"), status("VmHWM")
    start = time.perf_counter()
    with AnonPeak() as anon:
        if mode == "clone":
            kept, loaded = {}, 0
            for file in sorted({*checkpoint.weight_map.values()}):
                with safe_open(str(directory / file), framework="pt") as f:
                    for name in f.keys():
                        kept[name] = f.get_tensor(name).clone()
                        loaded += kept[name].nbytes
        elif mode.startswith("convert"):
            report = convert_kimi_to_exact(model, directory, mmap=mode.endswith("mmap"),
                                           progress=False)
            loaded = report.bytes_read
        else:
            model = hf.from_pretrained(directory, mmap=mode.endswith("mmap"), progress=False)
            loaded = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    seconds = time.perf_counter() - start
    return {"mode": mode, "seconds": seconds, "bytes": loaded,
            "anon_growth": anon.peak - anon0, "hwm_growth": status("VmHWM") - hwm0}


def run_child(mode: str, directory: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.bench_load", "--child", mode,
                          "--dir", str(directory)], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm(directory: Path) -> None:
    os.sync()  # no writeback of the files just written competes with the loads
    for file in directory.glob("*.safetensors"):
        with open(file, "rb") as f:
            while f.read(1 << 24):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/exactness-load"))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--child", choices=MODES)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch "
          f"{torch.__version__}")
    print("| experts | GB | load | seconds | GB/s | / clone | peak anon / GB | VmHWM / GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for experts in args.experts:
        directory = write(args.dir / f"experts-{experts}", experts)
        warm(directory)
        runs = {mode: [] for mode in args.modes}
        for _ in range(REPEATS):  # the modes in turn: the machine's drift reaches each alike
            for mode in args.modes:
                runs[mode].append(run_child(mode, directory))
        rates = {}
        for mode in args.modes:
            r = sorted(runs[mode], key=lambda r: r["seconds"])[REPEATS // 2]
            rate = r["bytes"] / r["seconds"] / 1e9
            rates[mode] = rate
            ratio = f"{rate / rates['clone']:.2f}" if "clone" in rates else "-"
            print(f"| {experts} | {r['bytes'] / 1e9:.2f} | {mode} | {r['seconds']:.2f} | "
                  f"{rate:.2f} | {ratio} | {r['anon_growth'] / r['bytes']:.3f} | "
                  f"{r['hwm_growth'] / r['bytes']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
