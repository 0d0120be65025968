"""The feature store: its schema, chunk files, damage checks and repair (docs/design.md §7)."""
