"""The chat template and loss masks: rendering through the template, the dropped-content check, rendered
rows -> token ids and masks."""
