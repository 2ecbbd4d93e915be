"""The config's errors: one line naming the key (or the file and row) and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


class DataError(ValueError):
    """A problem with the prompt files; the message names the file, row and column and the fix.
    Every rank reads the same files, so the launcher prints it once."""

    same_on_all_ranks = True
