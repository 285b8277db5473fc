"""The exceptions library code raises for bad input; ``cli/`` turns each into one line on
stderr and exit status 1. Every message is one line that names the file, flag or value."""

from __future__ import annotations


class ReDrafterError(Exception):
    """A failure the user can fix (bad input, missing file), not a bug."""


class ConfigError(ReDrafterError, ValueError):
    """Settings that cannot work together: a beam shape, a sampler, a prompt, a folder."""


class LoadError(ReDrafterError, ValueError):
    """A target model could not be loaded."""


class DrafterError(ReDrafterError, ValueError):
    """A drafter folder that cannot be used."""


class ConversionError(ReDrafterError, ValueError):
    """A conversion failed."""


class EmbeddedModelError(ReDrafterError, RuntimeError):
    """The embedded default model is not available."""


class Cancelled(ReDrafterError, RuntimeError):
    """The caller asked a generation to stop (its client left) before it finished."""


class ContextFull(ReDrafterError, RuntimeError):
    """The next step would not fit in the model's context window."""


class TrainError(ReDrafterError):
    """Drafter training cannot start or go on (bad options, data, cache or checkpoint)."""
