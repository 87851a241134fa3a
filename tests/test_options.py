"""specdec.options: options declared once, parsed with the messages every component gives."""

from __future__ import annotations

import copy
import math
import os
import pickle

import pytest
import specdec
from specdec.options import Option, Options, Values, non_empty

LEVELS = ("block", "continuation")


def _ladder(value):
    rungs = tuple(tuple(r) for r in value)
    if any(len(r) != 2 for r in rungs):
        raise ValueError(f"ladder rungs must be pairs; got {value!r}")
    return rungs


OPTIONS = Options(
    "demo",
    [
        Option("max_len", int, default=16, minimum=1),
        Option("edits", int, default=1, minimum=0, maximum=2, accepted="0, 1 or 2"),
        Option("learn", str, default="block", choices=LEVELS),
        Option("share", float, default=0.0, minimum=0, maximum=1),
        Option("decay", float, default=0.95, minimum=0, maximum=1, exclusive_minimum=True),
        Option("temp", float, default=1.0, minimum=0, exclusive_minimum=True),
        Option("shadow", bool, default=True),
        Option("path", (str, os.PathLike), accepted="a file path"),
        Option("head", str, default="exact", check=non_empty, accepted="a draft head name"),
        Option("ladder", default=((2, 4),), check=_ladder),
    ],
)


def _error(**given) -> str:
    with pytest.raises(specdec.PolicyError) as exc:
        OPTIONS.parse(given)
    return str(exc.value)


def test_defaults_fill_what_is_not_given():
    values = OPTIONS.parse({})
    assert isinstance(values, Values)
    assert dict(values) == dict(OPTIONS.defaults)
    assert values.max_len == 16 and values["learn"] == "block" and values.path is None
    assert values.ladder == ((2, 4),)


def test_valid_values_are_kept_and_numbers_become_floats():
    values = OPTIONS.parse(
        {"max_len": 3, "edits": 0, "learn": "continuation", "share": 1, "decay": 1, "path": "f"}
    )
    assert (values.max_len, values.edits, values.learn, values.path) == (3, 0, "continuation", "f")
    assert values.share == 1.0 and isinstance(values.share, float)
    assert values.decay == 1.0 and isinstance(values.decay, float)
    assert values.shadow is True  # the default, untouched
    assert OPTIONS.parse({"ladder": [[1, 2], [3, 4]]}).ladder == ((1, 2), (3, 4))


def test_values_are_read_only():
    values = OPTIONS.parse({})
    with pytest.raises(AttributeError):
        values.max_len = 3
    with pytest.raises(AttributeError, match="no option 'nope'"):
        _ = values.nope
    assert copy.deepcopy(values) == values == pickle.loads(pickle.dumps(values))


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"max_len": 0}, "demo: option max_len must be an integer >= 1, got 0"),
        ({"max_len": 2.0}, "demo: option max_len must be an integer >= 1, got 2.0"),
        ({"max_len": True}, "demo: option max_len must be an integer >= 1, got True"),
        ({"max_len": "3"}, "demo: option max_len must be an integer >= 1, got '3'"),
        ({"edits": 3}, "demo: option edits must be 0, 1 or 2, got 3"),
        ({"learn": "x"}, "demo: option learn must be one of ['block', 'continuation'], got 'x'"),
        ({"learn": 1}, "demo: option learn must be one of ['block', 'continuation'], got 1"),
        ({"share": 1.5}, "demo: option share must be a number in [0, 1], got 1.5"),
        ({"share": -0.1}, "demo: option share must be a number in [0, 1], got -0.1"),
        ({"share": False}, "demo: option share must be a number in [0, 1], got False"),
        ({"share": math.nan}, "demo: option share must be a number in [0, 1], got nan"),
        ({"decay": 0}, "demo: option decay must be a number in (0, 1], got 0"),
        ({"temp": 0.0}, "demo: option temp must be a number > 0, got 0.0"),
        ({"shadow": 1}, "demo: option shadow must be true or false, got 1"),
        ({"shadow": "yes"}, "demo: option shadow must be true or false, got 'yes'"),
        ({"path": 3}, "demo: option path must be a file path, got 3"),
        ({"head": ""}, "demo: option head must be a draft head name, got ''"),
        ({"head": None}, "demo: option head must be a draft head name, got None"),
        ({"ladder": [[1, 2, 3]]}, "demo: ladder rungs must be pairs; got [[1, 2, 3]]"),
    ],
)
def test_each_kind_of_error_names_the_option_the_value_and_what_is_accepted(given, message):
    assert _error(**given) == message


def test_none_is_accepted_only_where_the_default_is_none():
    assert OPTIONS.parse({"path": None}).path is None
    assert "max_len must be" in _error(max_len=None)


def test_unknown_options_are_refused_listing_the_accepted_ones():
    accepted = sorted(OPTIONS.options)
    assert _error(max_lne=3, zz=1) == (
        f"demo: unknown option(s) ['max_lne', 'zz']; accepted options are {accepted}"
    )


def test_a_check_without_a_message_gives_the_usual_one():
    def positive(v):
        if v == 0:
            raise ValueError
        return v * 2

    opts = Options("c", [Option("n", int, default=1, minimum=0, check=positive)])
    assert opts.parse({"n": 3}).n == 6  # the check's value is the one used
    with pytest.raises(specdec.PolicyError, match=r"^c: option n must be an integer >= 0, got 0$"):
        opts.parse({"n": 0})


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="declared twice"):
        Options("c", [Option("a", int, default=1), Option("a", int, default=2)])
    with pytest.raises(specdec.PolicyError, match="c: option a must be an integer >= 1, got 0"):
        Options("c", [Option("a", int, default=0, minimum=1)])
    assert OPTIONS["max_len"].describe() == "an integer >= 1"
    assert Option("x", int, minimum=0, maximum=9, exclusive_maximum=True).describe() == (
        "an integer in [0, 9)"
    )
    assert Option("x", float, maximum=2).describe() == "a number <= 2"


def test_the_single_value_helpers_give_the_same_messages():
    opt = specdec.options
    assert opt.int_option("c", "n", 5, 1) == 5
    assert opt.fraction_option("c", "f", 1) == 1.0
    assert opt.bool_option("c", "b", False) is False
    with pytest.raises(specdec.PolicyError, match="^c: option n must be an integer >= 1, got 0$"):
        opt.int_option("c", "n", 0, 1)
    with pytest.raises(specdec.PolicyError, match=r"^c: option f must be a number in \[0, 1\]"):
        opt.fraction_option("c", "f", math.nan)
    with pytest.raises(specdec.PolicyError, match="^c: option b must be true or false, got 1$"):
        opt.bool_option("c", "b", 1)
