"""The one error type of the conversion tools: its message names the tensor, file or flag."""

from __future__ import annotations


class ConversionError(ValueError):
    """Input that cannot be converted; nothing is written when it is raised."""
