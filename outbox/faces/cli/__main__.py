"""``python -m outbox.faces.cli`` runs the command line, as ``python -m outbox`` does."""

from outbox.faces.cli import main

raise SystemExit(main())
