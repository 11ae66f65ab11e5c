"""The one error type model loading raises, so callers (CLI, server start-up) can report it cleanly."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model path, config, architecture or weight file that cannot be loaded; the message names it."""
