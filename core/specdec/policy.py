"""The Policy: which components a pipeline is assembled from.

Build one from Python (``Policy(drafters=("ngram_copy",), governor="copy_governor")``),
from a dict (:meth:`Policy.from_dict`), from a TOML file (:meth:`Policy.from_toml`)
or from a preset name (:data:`PRESETS`: the core's ``none`` and ``draft``, and those
the plugins register through the hook ``specdec_register_policies``). :func:`load_policy` accepts any of these.

TOML layout (the same keys as the dict form)::

    drafters = ["ngram_copy"]
    governor = "copy_governor"
    acceptor = "auto"
    verifier = "logits"
    rollback = "auto"
    max_block = 16

    [options.ngram_copy]
    min_n = 2
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .errors import PolicyError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

AUTO = "auto"


def _name_tuple(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if value is None:
        return ()
    try:
        return tuple(value)
    except TypeError as exc:
        raise PolicyError(f"drafters must be a list of names, got {value!r}") from exc


def _check_names(inst: Any, attr: attrs.Attribute, value: tuple) -> None:
    for v in value:
        if not isinstance(v, str) or not v:
            raise PolicyError(f"{attr.name} must be non-empty strings, got {v!r}")
    if len(set(value)) != len(value):
        raise PolicyError(f"{attr.name} lists a name twice: {list(value)}")


def _check_name(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise PolicyError(f"{attr.name} must be a non-empty component name, got {value!r}")


def _check_optional_name(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _check_name(inst, attr, value)


def _check_optional_bool(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise PolicyError(f"{attr.name} must be true, false or left out, got {value!r}")


def _check_positive(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PolicyError(f"{attr.name} must be an integer >= 1, got {value!r}")


#: the accepted values of :attr:`Policy.batch_sizing`
BATCH_SIZINGS = ("width", "rows")


def _check_batch_sizing(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value not in BATCH_SIZINGS:
        raise PolicyError(f"batch_sizing must be one of {list(BATCH_SIZINGS)}, got {value!r}")


def _freeze_options(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PolicyError(
            f"options must be a table of component name -> table of options, got {value!r}"
        )
    out = {}
    for k, v in value.items():
        if not isinstance(v, Mapping):
            raise PolicyError(f"options for {k!r} must be a table of option -> value, got {v!r}")
        out[str(k)] = dict(v)
    return out


@attrs.frozen(kw_only=True)
class Policy:
    """Names the components of a pipeline and their options.

    Attributes:
        name: a label for stats and benches.
        drafters: drafter names in order; the first with a proposal wins a round.
            Empty: plain decoding (through the same loop).
        governor: optional governor name, applied to every drafter.
        acceptor: ``"auto"`` (greedy / point-mass / rejection from the sampler and
            the draft) or an acceptor name.
        verifier: verifier name (``"logits"``).
        rollback: ``"auto"`` (per cache type) or a cache-rollback name used for every layer.
        max_block: the largest block verified in one forward.
        min_block: blocks shorter than this are not verified (plain step instead).
        max_batch: the most requests decoded together as rows of one batch (1: one
            at a time). Above 1, every drafter, the governor and the verifier must
            declare ``supports_batch = True``; ``assemble`` refuses the policy otherwise.
        options: per-component options, ``{component_name: {option: value}}``.
        batch_sizing: how the rows of a batch are sized: ``"width"`` (the default): a
            round's forward is as wide as the rows' blocks make it pay for every row, the
            blocks that carry acceptance estimates (:attr:`specdec.Draft.acceptance`)
            cut to that width (:func:`specdec.costs.best_width`, from the verify cost of
            a batch of that many rows); ``"rows"``: each row's block as its drafter
            sized it alone.
        forced_drafts: whether a request with a ``grammar`` drafts the tokens its
            grammar forces (the keys of a schema, punctuation; they open the round's
            block and cannot be rejected). ``None`` (the default): when the policy has
            drafters. ``True`` on a policy without drafters: forced tokens are its
            only drafts (preset ``forced``).
    """

    name: str = attrs.field(default="custom", validator=_check_name)
    drafters: tuple[str, ...] = attrs.field(
        default=(), converter=_name_tuple, validator=_check_names
    )
    governor: str | None = attrs.field(default=None, validator=_check_optional_name)
    acceptor: str = attrs.field(default=AUTO, validator=_check_name)
    verifier: str = attrs.field(default="logits", validator=_check_name)
    rollback: str = attrs.field(default=AUTO, validator=_check_name)
    max_block: int = attrs.field(default=16, validator=_check_positive)
    min_block: int = attrs.field(default=1, validator=_check_positive)
    max_batch: int = attrs.field(default=1, validator=_check_positive)
    batch_sizing: str = attrs.field(default="width", validator=_check_batch_sizing)
    options: dict = attrs.field(factory=dict, converter=_freeze_options, hash=False)
    forced_drafts: bool | None = attrs.field(default=None, validator=_check_optional_bool)

    @property
    def forces(self) -> bool:
        """Whether constrained requests draft their grammar's forced tokens."""
        return bool(self.drafters) if self.forced_drafts is None else self.forced_drafts

    def __attrs_post_init__(self) -> None:
        if self.min_block > self.max_block:
            raise PolicyError(
                f"min_block ({self.min_block}) must be <= max_block ({self.max_block})"
            )

    FIELDS = (
        "name",
        "drafters",
        "governor",
        "acceptor",
        "verifier",
        "rollback",
        "max_block",
        "min_block",
        "max_batch",
        "batch_sizing",
        "options",
        "forced_drafts",
    )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Build a policy from a dict with the attribute names as keys.

        Raises:
            PolicyError: unknown keys or bad values, naming the accepted keys.
        """
        if not isinstance(data, Mapping):
            raise PolicyError(f"a policy dict must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.FIELDS))
        if unknown:
            raise PolicyError(
                f"unknown policy key(s) {unknown}; accepted keys are {list(cls.FIELDS)}"
            )
        try:
            return cls(**dict(data))
        except PolicyError:
            raise
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"invalid policy: {exc}") from exc

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> Policy:
        """Read a policy from a TOML file.

        Raises:
            PolicyError: the file is missing or is not valid TOML, with the parser's message.
        """
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise PolicyError(f"cannot read policy file {str(p)!r}: {exc.strerror or exc}") from exc
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PolicyError(f"policy file {str(p)!r} is not valid TOML: {exc}") from exc
        data.setdefault("name", p.stem)
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        """The dict form (round-trips through :meth:`from_dict`)."""
        d = attrs.asdict(self)
        d["drafters"] = list(self.drafters)
        return d

    def with_options(self, component: str, **options: Any) -> Policy:
        """A copy with ``options`` merged into ``component``'s options."""
        merged = {k: dict(v) for k, v in self.options.items()}
        merged.setdefault(component, {}).update(options)
        return attrs.evolve(self, options=merged)

    def options_for(self, component: str) -> dict:
        """The options the policy gives ``component`` (a fresh dict)."""
        return dict(self.options.get(component, {}))


#: The core's presets: plain decoding, and the built-in draft model drafting alone. The
#: presets that name plugin components come from those plugins (the hook
#: ``specdec_register_policies``); the core registers these two through it too.
CORE_PRESETS: dict[str, Policy] = {
    "none": Policy(name="none"),
    "draft": Policy(name="draft", drafters=("draft_model",)),
    "forced": Policy(name="forced", forced_drafts=True),
}
