"""The base class of the train loop's user-facing errors: a complete one-line message, no traceback needed.

Every failure a user can cause or fix while running a recipe (a locked run
directory, a checkpoint that is missing, corrupt or from another run, a run
that diverged) raises a subclass of `RunError`. Its message names the path,
the step or the field involved and what to do, so the `spillway` command
prints the message alone. Imports nothing heavy: the command line imports it
before JAX starts.
"""

from __future__ import annotations

from spillway.layers.errors import SpillwayError


class RunError(SpillwayError, RuntimeError):
    """A run cannot go on; str(error) is one line that says why and names what is involved."""
