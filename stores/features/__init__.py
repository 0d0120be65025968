"""The feature store: its schema, chunk files, damage checks and repair, the stream plan (docs/design.md §7)."""
