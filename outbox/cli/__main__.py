"""``python -m outbox.cli`` runs the command line, as ``python -m outbox`` does."""

from outbox.cli import main

raise SystemExit(main())
