"""`python -m engine.models`: print the supported-models table (docs/models.md)."""

from engine.models import table

print(table(), end="")
