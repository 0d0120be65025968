"""The tool commands ``peagle-data inspect``, ``verify``, ``stats``, ``show``: each command's config beside
its library call."""
