"""``python -m outbox`` runs the command line."""

from outbox.faces.cli import main

raise SystemExit(main())
