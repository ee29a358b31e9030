"""``python -m amp_fx inspect MODEL ...``: see `amp_fx.cli`."""

from amp_fx.cli import main

raise SystemExit(main())
