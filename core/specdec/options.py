"""Checks for component options, with the error messages every component gives.

A factory that takes ``**options`` checks them itself (the plugin host can only bind
named parameters)::

    def create_my_drafter(**options):
        specdec.options.reject_unknown("my_drafter", options, DEFAULTS)
        return MyDrafter(**options)

Each check raises :class:`specdec.PolicyError` naming the component, the option, the
value given and what would be accepted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import PolicyError

__all__ = ["bool_option", "fraction_option", "int_option", "parse_value", "reject_unknown"]


def reject_unknown(component: str, options: dict, accepted: Iterable[str]) -> None:
    """Raise when ``options`` has a name outside ``accepted`` (listing the accepted ones)."""
    accepted = sorted(accepted)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise PolicyError(
            f"{component}: unknown option(s) {unknown}; accepted options are {accepted}"
        )


def int_option(component: str, label: str, value: Any, minimum: int) -> int:
    """``value`` as an integer ``>= minimum`` (``bool`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PolicyError(
            f"{component}: option {label} must be an integer >= {minimum}, got {value!r}"
        )
    return value


def fraction_option(component: str, label: str, value: Any) -> float:
    """``value`` as a number in [0, 1] (``bool`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise PolicyError(f"{component}: option {label} must be a number in [0, 1], got {value!r}")
    return float(value)


def bool_option(component: str, label: str, value: Any) -> bool:
    """``value`` as ``True`` or ``False`` (nothing else)."""
    if not isinstance(value, bool):
        raise PolicyError(f"{component}: option {label} must be true or false, got {value!r}")
    return value


def parse_value(text: str) -> Any:
    """An option value written on a command line: an int, a float, ``true``/``false``
    (any case), else the string (stripped)."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text.strip()
