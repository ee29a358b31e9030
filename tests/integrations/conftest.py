"""The trainer integrations' tests need the trainer libraries, which `make test` installs
(requirements-dev.txt); a machine without them (the GPU image) skips those files."""

from __future__ import annotations

import importlib.util

_NEEDS = {
    "test_lightning*.py": "lightning",
    "test_transformers_trainer.py": "accelerate",
    "test_hf_trainer_ddp.py": "accelerate",
    "test_trl_sft_trainer.py": "trl",
}
collect_ignore_glob = [files for files, needs in _NEEDS.items() if importlib.util.find_spec(needs) is None]
