"""Warnings that are emitted once per process, so a knob ignored in a loop does not flood the log."""

import warnings

_seen: set[str] = set()


def warn_once(message: str, *, category: type[Warning] = UserWarning) -> None:
    """Emit ``message`` as a warning the first time it is seen in this process.

    Args:
        message: the full text; identical texts are emitted once.
        category: the warning class.
    """
    if message in _seen:
        return
    _seen.add(message)
    warnings.warn(message, category, stacklevel=3)
