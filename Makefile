# The two commands a newcomer needs: `make demo` and `make test`. Both do the whole set-up.
PYTHON ?= python3
VENV ?= .venv
# PyPI's torch for x86-64 Linux is a CUDA build; the CPU-only one: make TORCH_SPEC='torch==2.13.0+cpu'
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu ... (pip reads it from the environment)
TORCH_SPEC ?= torch==2.13.0
# TensorFlow for collectives.tensorflow and collectives.keras (CPU build by default; e.g.
# TF_SPEC='tensorflow[and-cuda]==2.21.0' on GPUs), and Keras 2 (tf_keras) to match it.
TF_SPEC ?= tensorflow-cpu==2.21.0
TF_KERAS_SPEC ?= tf_keras~=2.21.0
NP ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hvdrun-installed
# The stamp holds the specs it was made with: the set-up runs again when they change (make demo
# TORCH_SPEC=...), as when pyproject.toml does. An empty stamp (older Makefiles) is taken as is.
SETUP_SPECS := $(strip $(TORCH_SPEC) $(TF_SPEC) $(TF_KERAS_SPEC))
STAMPED_SPECS := $(strip $(shell cat $(STAMP) 2>/dev/null))
ifneq ($(STAMPED_SPECS),)
ifneq ($(STAMPED_SPECS),$(SETUP_SPECS))
.PHONY: $(STAMP)
endif
endif

.PHONY: setup demo test lint proto bench gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TF_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,examples,keras,lightning,accelerate,ray,spark]'
	# (tf_keras names the full "tensorflow" package: the one installed above serves it)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps "$(TF_KERAS_SPEC)"
	printf '%s\n' '$(SETUP_SPECS)' > $(STAMP)

demo: setup
	$(VENV)/bin/hvdrun -np $(NP) $(PY) examples/pytorch_digits.py

# Byte-compiled once first: where PYTHONDONTWRITEBYTECODE is set (as on some CI images), each
# of the hundreds of processes the tests start would compile the project's modules again.
test: setup
	$(PY) -m compileall -q -j 0 collectives rendezvous launcher hvdrun tests
	$(PY) -m pytest -q tests

# ruff, mypy, and the import layers (tests/test_layers.py: no cycles, nothing imports upward).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py

# Regenerates the committed gRPC code; tests/rendezvous/test_proto.py fails when it is stale.
proto: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
		rendezvous/rendezvous.proto

# Every bench/*.py prints its own table of medians and ratios against a baseline of the same run.
bench: setup
	@set -e; for script in bench/*.py; do echo "== $$script"; $(PY) $$script; done

# On a machine with a GPU: the GPU tests and the CUDA benchmarks, one table (docs/gpu.md).
gpu-check: setup
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
