"""``outbox ui``: a local dashboard over one open outbox (overview, memories, dead letters).

Served by Starlette and uvicorn from templates and files inside this package; nothing is
fetched at run time. Every request needs the session token that ``outbox ui`` prints, and
state-changing actions are POST forms guarded against cross-site requests (``access.py``).
"""
