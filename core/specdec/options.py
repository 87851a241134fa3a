"""Component options, declared once and checked with the error messages every component gives.

A component declares each of its options once (type, range, choices, default) and
its constructor reads the validated values::

    from specdec.options import Option, Options

    OPTIONS = Options("my_drafter", [
        Option("max_len", int, default=16, minimum=1),
        Option("mode", str, default="block", choices=("block", "continuation")),
        Option("decay", float, default=0.95, minimum=0, maximum=1, exclusive_minimum=True),
    ])

    class MyDrafter(specdec.BaseDrafter):
        def __init__(self, **options):
            o = OPTIONS.parse(options)  # unknown names and bad values raise here
            self.max_len = o.max_len

Each check raises :class:`specdec.PolicyError` naming the component, the option, the
value given and what would be accepted
(``"my_drafter: option max_len must be an integer >= 1, got 0"``). The single-value
helpers (:func:`int_option`, :func:`fraction_option`, :func:`bool_option`,
:func:`reject_unknown`) give the same messages without a declaration.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from .errors import PolicyError

__all__ = [
    "Option",
    "Options",
    "Values",
    "bool_option",
    "check_signature",
    "fraction_option",
    "int_option",
    "non_empty",
    "parse_value",
    "reject_unknown",
]


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


@attrs.frozen
class Option:
    """One option of a component: its name, what it accepts and its default.

    Args:
        name: the option's name in the policy.
        kind: the type(s) a value must have. ``bool`` is not an ``int`` here unless
            named; ``float`` also takes an ``int`` (and gives a ``float``); ``object``
            takes anything (leave the test to ``choices`` or ``check``).
        default: the value when the option is not given. ``None`` means the option may
            be left unset: a given ``None`` is then accepted as it is.
        minimum, maximum: the range of a number (inclusive unless
            ``exclusive_minimum`` / ``exclusive_maximum``); NaN is outside every range.
        choices: the values accepted (compared with ``==``).
        check: a last test of the value as given, run once the others pass; it
            returns the value to use (it may convert it) or raises ``ValueError``:
            with a message, the error is ``"<component>: <message>"``; without, the
            option's usual ``"must be <accepted>"`` message.
        accepted: what is accepted, in words, for the error message; by default it is
            written from the declaration (``"an integer >= 1"``, ``"a number in [0, 1]"``,
            ``"true or false"``, ``"one of ['a', 'b']"``).
    """

    name: str
    kind: type | tuple[type, ...] = object
    default: Any = attrs.field(default=None, kw_only=True)
    minimum: float | None = attrs.field(default=None, kw_only=True)
    maximum: float | None = attrs.field(default=None, kw_only=True)
    exclusive_minimum: bool = attrs.field(default=False, kw_only=True)
    exclusive_maximum: bool = attrs.field(default=False, kw_only=True)
    choices: tuple | None = attrs.field(
        default=None, kw_only=True, converter=attrs.converters.optional(tuple)
    )
    check: Callable[[Any], Any] | None = attrs.field(default=None, kw_only=True)
    accepted: str | None = attrs.field(default=None, kw_only=True)

    def describe(self) -> str:
        """What the option accepts, in words (the end of its error message)."""
        if self.accepted is not None:
            return self.accepted
        if self.choices is not None:
            return f"one of {list(self.choices)}"
        kinds = _kinds(self.kind)
        if kinds == (bool,):
            return "true or false"
        if kinds == (int,):
            noun = "an integer"
        elif float in kinds:
            noun = "a number"
        else:
            noun = "a " + " or ".join("string" if k is str else k.__name__ for k in kinds)
        lo, hi = self.minimum, self.maximum
        if lo is not None and hi is not None:
            left = "(" if self.exclusive_minimum else "["
            right = ")" if self.exclusive_maximum else "]"
            return f"{noun} in {left}{lo}, {hi}{right}"
        if lo is not None:
            return f"{noun} {'>' if self.exclusive_minimum else '>='} {lo}"
        if hi is not None:
            return f"{noun} {'<' if self.exclusive_maximum else '<='} {hi}"
        return noun

    def error(self, component: str, value: Any) -> PolicyError:
        """The error for ``value``: ``"<component>: option <name> must be ..., got <value>"``."""
        return PolicyError(
            f"{component}: option {self.name} must be {self.describe()}, got {value!r}"
        )

    def parse(self, component: str, value: Any) -> Any:
        """``value`` checked against the declaration: the value to use.

        Raises:
            PolicyError: ``value`` is not accepted (naming ``component``, the option,
                ``value`` and what is accepted).
        """
        if value is None and self.default is None:
            return None
        if not self._fits(value):
            raise self.error(component, value)
        if self.check is not None:
            try:
                return self.check(value)
            except ValueError as exc:
                if str(exc):
                    raise PolicyError(f"{component}: {exc}") from None
                raise self.error(component, value) from None
        if float in _kinds(self.kind) and isinstance(value, int):
            return float(value)
        return value

    def _fits(self, value: Any) -> bool:
        kinds = _kinds(self.kind)
        if isinstance(value, bool):
            if not (bool in kinds or object in kinds):
                return False
        elif not isinstance(value, (*kinds, int) if float in kinds else kinds):
            return False
        if self.minimum is not None or self.maximum is not None:
            try:
                # written so that NaN fails both
                if self.minimum is not None and not (
                    value > self.minimum if self.exclusive_minimum else value >= self.minimum
                ):
                    return False
                if self.maximum is not None and not (
                    value < self.maximum if self.exclusive_maximum else value <= self.maximum
                ):
                    return False
            except TypeError:  # not a number
                return False
        return self.choices is None or value in self.choices


class Values(Mapping[str, Any]):
    """A component's validated options: a read-only mapping whose names are also
    attributes (``values.max_len`` or ``values["max_len"]``)."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # e.g. copy and pickle probing, before _values is set
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no option {name!r}") from None

    def __reduce__(self) -> tuple:
        return (Values, (self._values,))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("option values are read-only")

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Values({self._values!r})"


class Options:
    """The options of one component, each declared once.

    Args:
        component: the component's name (the start of every error message).
        options: its :class:`Option` declarations.

    Raises:
        ValueError: a name declared twice.
        PolicyError: a default the declaration does not accept (a bug in it).
    """

    def __init__(self, component: str, options: Iterable[Option]) -> None:
        self.component = component
        declared: dict[str, Option] = {}
        for opt in options:
            if opt.name in declared:
                raise ValueError(f"{component}: option {opt.name} is declared twice")
            declared[opt.name] = opt
        #: The declarations by name (read-only).
        self.options: Mapping[str, Option] = MappingProxyType(declared)
        #: The default of every option, as validated (read-only).
        self.defaults: Mapping[str, Any] = MappingProxyType(
            {n: o.parse(component, o.default) for n, o in self.options.items()}
        )

    def __getitem__(self, name: str) -> Option:
        """The declaration of option ``name``."""
        return self.options[name]

    def parse(self, given: Mapping[str, Any]) -> Values:
        """``given`` checked against the declarations, with the defaults filled in.

        Raises:
            PolicyError: an unknown name (listing the accepted ones) or a value an
                option does not accept.
        """
        reject_unknown(self.component, given, self.options)
        values = dict(self.defaults)
        for name, opt in self.options.items():
            if name in given:
                values[name] = opt.parse(self.component, given[name])
        return Values(values)


def non_empty(value: Any) -> Any:
    """A ``check`` for :class:`Option`: refuses an empty value (``""``) with the
    option's usual message."""
    if not value:
        raise ValueError
    return value


def reject_unknown(component: str, options: Mapping | Iterable, accepted: Iterable[str]) -> None:
    """Raise when ``options`` has a name outside ``accepted`` (listing the accepted ones)."""
    accepted = sorted(accepted)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise PolicyError(
            f"{component}: unknown option(s) {unknown}; accepted options are {accepted}"
        )


def int_option(component: str, label: str, value: Any, minimum: int) -> int:
    """``value`` as an integer ``>= minimum`` (``bool`` is refused)."""
    return Option(label, int, default=minimum, minimum=minimum).parse(component, value)


def fraction_option(component: str, label: str, value: Any) -> float:
    """``value`` as a number in [0, 1] (``bool`` is refused)."""
    return Option(label, float, default=0.0, minimum=0, maximum=1).parse(component, value)


def bool_option(component: str, label: str, value: Any) -> bool:
    """``value`` as ``True`` or ``False`` (nothing else)."""
    return Option(label, bool, default=False).parse(component, value)


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


_SCALARS = (bool, int, float, str)


def _parameter_kinds(p: inspect.Parameter) -> tuple[tuple[type, ...], bool] | None:
    """The scalar types a parameter takes and whether it takes ``None``, from its
    annotation (``int``, ``float | None``, ...) or else its default's type; ``None`` when
    neither says (no annotation and no scalar default, or a non-scalar annotation)."""
    ann = p.annotation
    if ann is not p.empty and not isinstance(ann, str):
        args = typing.get_args(ann) if typing.get_origin(ann) in _UNIONS else (ann,)
        if all(a in _SCALARS or a is type(None) for a in args):
            kinds = tuple(a for a in args if a is not type(None))
            return (kinds, len(kinds) < len(args) or p.default is None) if kinds else None
        return None
    if p.default is not p.empty and type(p.default) in _SCALARS:
        return (type(p.default),), False
    return None


_UNIONS = (typing.Union, types.UnionType)


def check_signature(component: str, sig: inspect.Signature, options: Mapping[str, Any]) -> None:
    """Options given to a component that declares none (its factory takes them as keyword
    parameters) checked against each parameter's annotation, or else its default's type
    (``max_len: int = 8`` or ``max_len=8``: an integer; ``ratio=0.5``: a number). Values of
    parameters with neither pass unchecked.

    Raises:
        PolicyError: ``"<component>: option max_len must be an integer, got '8'"``.
    """
    for name, value in options.items():
        p = sig.parameters.get(name)
        found = None if p is None else _parameter_kinds(p)
        if found is None:
            continue
        kinds, takes_none = found
        if value is None and takes_none:
            continue
        Option(name, kinds, default=0).parse(component, value)
