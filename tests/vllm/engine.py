"""One vLLM engine with the plugin, in a process of its own (a test starts it with `run`): greedy
generation of the tests' prompts, every MoE call captured (exactness.stacked's capture), and
what the engine holds, written to a directory the test reads.

    python -m tests.vllm.engine MODEL OUT [--compile] [--block exact|transformers]
                                [--tp N] [--no-quantization] [--text]

OUT/result.json: the generated token ids per phase, the routed experts' bytes in the engine.
OUT/alone/, OUT/mixed/: the captures of one prompt alone, then among others of other lengths.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

ALONE = [[5, 17, 33, 61, 99, 140, 201]]
MIXED = [[7, 8, 9], ALONE[0], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310], [42]]
NEW_TOKENS = 4
TEXT = ["w1 w2 w3 w4", "w10 w20 w30"]  # --text: through the checkpoint's tokenizer
CHAT = [{"role": "user", "content": "w5 w6 w7"}]


def run(model: Path, out: Path, *args: str, env: dict | None = None, timeout: int = 900):
    """The engine in a child process; its output (stdout and stderr) also in OUT/engine.log.
    Compiled, it logs the graphs Dynamo makes (TORCH_LOGS), where a test looks for the op."""
    out.mkdir(parents=True, exist_ok=True)
    logs = {"TORCH_LOGS": "graph_code,graph_breaks"} if "--compile" in args else {}
    done = subprocess.run([sys.executable, "-m", "tests.vllm.engine", str(model), str(out),
                           *args], env={**os.environ, **logs, **(env or {})},
                          capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[2])
    (out / "engine.log").write_text(done.stdout + done.stderr)
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--block", default="exact")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--no-quantization", action="store_true")
    parser.add_argument("--text", action="store_true",
                        help="TEXT and CHAT through the tokenizer, as a server takes them")
    args = parser.parse_args()
    out = Path(args.out)
    os.environ["EXACTNESS_BLOCK"] = args.block
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=args.model, dtype="bfloat16", enforce_eager=not args.compile,
                  skip_tokenizer_init=not args.text, max_model_len=256, seed=0,
                  tensor_parallel_size=args.tp)
    if not args.no_quantization:
        kwargs["quantization"] = "exactness"
    llm = LLM(**kwargs)
    if args.text:
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
        # one request at a time, as the server test sends them: vLLM's bf16 layers are not
        # batch invariant on the CPU, and the tiny model's logits are close
        result = {"completions": [llm.generate([t], greedy)[0].outputs[0].text for t in TEXT],
                  "chat": llm.chat(CHAT, greedy)[0].outputs[0].text}
        (out / "result.json").write_text(json.dumps(result))
        return
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, detokenize=False)
    result = {}
    for phase, prompts in (("alone", ALONE), ("mixed", MIXED)):
        (out / phase).mkdir(parents=True, exist_ok=True)
        os.environ["EXACTNESS_CAPTURE"] = str(out / phase)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy)
        result[phase] = [list(o.outputs[0].token_ids) for o in outputs]
    os.environ.pop("EXACTNESS_CAPTURE")
    result["experts_bytes"] = sum(llm.apply_model(experts_bytes))
    llm.apply_model(functools.partial(replay_rows, out / "mixed"))
    (out / "result.json").write_text(json.dumps(result))


def experts_bytes(model) -> int:
    """The bytes of every routed-expert layer's weights in the engine: vLLM's parameters, and
    the plugin's views of them (exactness.stacked), each storage counted once. (vLLM's routing
    tensors, expert_mask and the router's bias, are not the experts'.)"""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from exactness import stacked

    tensors = [t for module in model.modules() if isinstance(module, RoutedExperts)
               for name, t in module.named_parameters(recurse=False)
               if name.startswith(("w13_", "w2_"))]  # not the router's correction bias
    tensors += [t for _, experts in stacked._VIEWS.values() for t in experts.buffers()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def replay_rows(directory: Path, model) -> None:
    """Each captured call's rows again, one row a call, through the engine's own layer and
    method (vLLM's tensors): written beside the call's batched output as "rows_alone"."""
    import torch

    layers = {name: module for name, module in model.named_modules()
              if hasattr(module, "quant_method") and hasattr(module, "w13_weight_packed")}
    for path in sorted(directory.glob("*.pt")):
        call = torch.load(path)
        layer = next(m for m in layers.values() if m.layer_name == call["layer"])
        os.environ.pop("EXACTNESS_CAPTURE", None)
        rows = [layer.quant_method.apply(layer, call["x"][r:r + 1], call["weights"][r:r + 1],
                                         call["ids"][r:r + 1]) for r in range(len(call["x"]))]
        torch.save(call | {"rows_alone": torch.cat(rows)}, path)


if __name__ == "__main__":
    main()
