# Everything the project needs is installed here: `make test` and `make demo` work on a fresh
# machine with only Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint slow gpu-test clean

$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=64" wheel
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# CPU-only machines run the Triton kernels in the interpreter.
test: $(STAMP)
	TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m "not slow and not gpu" tests

slow: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m slow tests

gpu-test: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
