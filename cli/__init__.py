"""Thin click commands: options in, one library call, output. Exit code 2 on a PeagleError."""
