"""`CheckpointError`: bad checkpoint input or output (missing/truncated files, shape mismatch, existing output).

Tools print its message as one line and exit with status 2.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be read or written as asked; the message says what and where."""


EXIT_BAD_INPUT = 2
