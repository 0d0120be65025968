"""The assistant loss mask: rendering through the chat template (``render``), content the template drops
(``dropped``) and special-token text in replies (``special_text``), spans -> token loss masks (``loss_mask``), the
served-prompt checks (``served``), turns trained on generated ids (``generated_ids``), and conversations -> ids and
masks (``tokens``)."""
