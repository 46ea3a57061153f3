"""One exception type for problems the user can fix, and the CLI wrapper that prints it."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class UserError(Exception):
    """Bad input (a path, a shape, a flag, a request): the message names the problem."""


def cli_errors(main: F) -> F:
    """Turn a UserError / missing file into one `error: ...` line and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (UserError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]
