"""``python -m outbox`` runs the command line."""

from outbox.cli import main

raise SystemExit(main())
