"""Conversation readers: files, globs and the ``sharegpt`` alias -> normalised OpenAI messages
(:mod:`.conversations`)."""
