"""What every layer stands on: the record model (keys, slugs, record, states, receipt), the
library's errors, its settings, and the owner-only folders and files it creates.

Pure or nearly so, and importing nothing else of ``outbox``.
"""
