"""``python -m amp_fx inspect MODEL ...``: see `amp_fx.inspect.cli`."""

from amp_fx.inspect.cli import main

raise SystemExit(main())
