"""The same cases through the C kernels (on the CPU) and the Triton kernels (on the suite's
device: a GPU, or the interpreter): equal to each other and to the reference, bit for bit.

On a machine with a GPU (make verify DEVICE=cuda) this is the check that the CPU and the GPU
give the same bits; under the interpreter it ties the two wings' logic the same way."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from exactness.formats import tensor_to_bits
from exactness.kernels import REGISTRY
from exactness.suite.cases import load_vectors
from exactness.suite.counterexamples import check_bits, write
from exactness.suite.device import chosen, describe
from exactness.suite.gate.repro import replay, where
from exactness.suite.paths import held_act_bits, require, run
from exactness.suite.strategies import linear_cases, moe_cases, routed_cases
from tests.test_moe import experts_of, inputs

pytestmark = pytest.mark.stage("devices")  # make verify's stage

ROOT = Path(__file__).resolve().parents[1]
GROUPED = {kernel.family: kernel.name for kernel in REGISTRY if kernel.grouped}


def share(part: int):
    """A 1/part share of the profile's examples, at least 5: the equivalence stage checks each
    path against the reference at full count; here the two devices meet."""
    return settings(max_examples=max(5, settings.default.max_examples // part))


def agree(case, cpu: str, gpu: str) -> None:
    """`case` on the `cpu` path and the `gpu` path, each against the reference (check_bits
    writes a counterexample file for the first that differs), then against each other."""
    want = run(case, "reference")
    on_cpu, on_gpu = run(case, cpu), run(case, gpu)
    check_bits(case, cpu, on_cpu, want, source="devices")
    check_bits(case, gpu, on_gpu, want, source="devices")
    assert np.array_equal(on_cpu, on_gpu)


@share(3)
@given(linear_cases(max_k=128, max_n=24, max_rows=18, act_bits_=held_act_bits("triton-group")))
def test_a_layer_gives_the_same_bits_on_the_cpu_and_the_triton_device(case):
    """The layer as each backend's plan picks (the C kernels; the Triton kernels)."""
    require("triton")
    agree(case, "cpu", "triton")


@share(3)
@given(routed_cases(max_experts=4, max_rows=10, act_bits_=held_act_bits(GROUPED["triton"])))
def test_a_grouped_projection_gives_the_same_bits_on_both(case):
    """One grouped call (every expert's routed rows), on each backend's grouped kernel."""
    require(GROUPED["cpu"])
    require(GROUPED["triton"])
    agree(case, GROUPED["cpu"], GROUPED["triton"])


@share(10)
@given(moe_cases(max_experts=3, max_tokens=6, max_hidden=64,
                 act_bits_=held_act_bits(GROUPED["triton"])))
def test_the_moe_experts_give_the_same_bits_on_both(case):
    """transformers' experts module, exact: its whole forward (gate, up, SiLU, down, the
    weighted sum) on the CPU, and moved to the Triton device; the same bits, NaN rows too."""
    require(GROUPED["triton"])
    on_cpu, on_gpu = experts_of(case, "cpu"), experts_of(case, "triton")  # each on its device
    want = tensor_to_bits(on_cpu(*inputs(case)))
    got = tensor_to_bits(on_gpu(*inputs(case, on_gpu)))
    assert np.array_equal(want, got)


# --------------------------------------------------------------------------- the choice itself

def child(code: list[str], **env: str) -> subprocess.CompletedProcess:
    keep = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",
                                                            "EXACTNESS_DEVICE")}
    return subprocess.run([sys.executable, *code], cwd=ROOT, env={**keep, **env},
                          capture_output=True, text=True, timeout=300)


def test_a_device_this_machine_lacks_is_refused_never_replaced():
    """EXACTNESS_DEVICE=cuda where no GPU is seen is a DeviceError naming why (verify restarts
    itself once on the device asked for, then refuses: no loop, no quiet interpreter); a name
    that is no device is refused at import."""
    done = child(["-m", "exactness", "verify", "--device", "cuda", "--stage", "corpus"],
                 CUDA_VISIBLE_DEVICES="")
    assert done.returncode != 0
    assert "DeviceError: EXACTNESS_DEVICE=cuda, but" in done.stderr, done.stderr[-2000:]
    assert "sees no CUDA device" in done.stderr or "Triton is not installed" in done.stderr
    done = child(["-c", "import exactness"], EXACTNESS_DEVICE="gpu")
    assert "EXACTNESS_DEVICE must be one of interpret, cuda, got 'gpu'" in done.stderr


def test_a_counterexample_records_its_device_and_replays_on_the_one_asked(tmp_path):
    case = load_vectors()[5]
    file = write(case, path="triton", expected=case.expected, actual=case.expected,
                 directory=tmp_path)
    recorded = json.loads(file.read_text())["device"]
    assert recorded == describe() and recorded["device"] == chosen()
    out = io.StringIO()
    assert replay(str(file), ["triton"], out=out) == 0
    assert f"replayed on {where(describe())}" in out.getvalue()
    done = child(["-m", "exactness", "repro", "--device", "interpret", "--path", "triton",
                  str(file)])
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "replayed on the Triton interpreter" in done.stdout
