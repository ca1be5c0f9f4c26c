"""Test-only helpers: programs and fixtures that stand in for outside services."""
