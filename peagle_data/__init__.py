"""Data preparation: conversation readers, chat templates and loss masks, windows, packing,
hidden-state extraction. Writes through ``stores``."""
