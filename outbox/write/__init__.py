"""The durable write: validate, commit the record and its outbox rows in one transaction,
or land it in the markdown fallback queue, and import that queue again later.

Imports no sink and no dispatcher, so a save can never wait on a model.
"""
