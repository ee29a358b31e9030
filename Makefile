# Everything the project needs is installed here: `make test` and `make demo` work on a fresh
# machine with only Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint slow thorough gpu-test clean

# The first run installs everything (a few minutes, mostly torch); each step says what it does.
$(STAMP): requirements-dev.txt pyproject.toml setup.py
	@echo "[1/4] creating $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV)
	@echo "[2/4] installing pip, setuptools>=77, wheel"
	@$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel
	@echo "[3/4] installing torch, torchvision, transformers, pytest, pytest-xdist, hypothesis, ruff, tqdm (requirements-dev.txt) ... (about 2 minutes)"
	@$(PY) -m pip install -q -r requirements-dev.txt
	@echo "[4/4] installing amp_fx (editable)"
	@# setuptools notes that an editable install maps packages (passes/ -> amp_fx.passes), which is
	@# this layout's intent: that one informational message is filtered, nothing else.
	@PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)
	@echo "done: $(VENV) is ready"

# pytest's own script, not `python -m pytest`, which would put the repository root first on sys.path
# (its kernels/ would hide Hugging Face's `kernels`; tests/conftest.py moves the root last anyway,
# for xdist's workers and any other way of running). CPU-only machines run the Triton kernels in the interpreter; two workers use both cores of CI's
# machine (every test is independent: seeded, in its own tmp_path, distributed ones on file stores).
test: $(STAMP)
	TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=ci $(VENV)/bin/pytest -q -n 2 -m "not slow and not gpu" tests

# The property tests (every test file that uses hypothesis) with the "thorough" profile: 20x CI's examples.
thorough: $(STAMP)
	TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=thorough $(VENV)/bin/pytest -q -m "not slow and not gpu" \
		$$(grep -rl --include='test_*.py' -e '^from hypothesis' -e '^import hypothesis' tests)

slow: $(STAMP)
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -m slow tests

gpu-test: $(STAMP)
	$(VENV)/bin/pytest -q -m gpu tests

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
