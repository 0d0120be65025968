"""How a conversation is rendered and an answer parsed as the serving stack does: chat templates, answer parsing, settings drawn per row (docs/design.md §3)."""
