"""Token tables and conversation files: the Arrow tables of tokenize/pack, their typed rows, regenerate's JSONL files, question rows (docs/design.md §6)."""
