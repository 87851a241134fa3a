"""specdec.Policy: presets, dict and TOML forms, validation and round trips."""

from __future__ import annotations

import attrs
import pytest
import specdec
from specdec.errors import PolicyError
from specdec.policy import AUTO, Policy
from specdec.presets import PRESETS, load_policy

# -- defaults and presets ---------------------------------------------------------


def test_defaults_are_plain_decoding():
    p = Policy()
    assert p.name == "custom"
    assert p.drafters == ()
    assert p.governor is None
    assert p.acceptor == AUTO == "auto"
    assert p.verifier == "logits"
    assert p.rollback == "auto"
    assert p.max_block == 16
    assert p.min_block == 1
    assert p.options == {}


def test_public_names():
    assert specdec.Policy is Policy
    assert specdec.presets.PRESETS is PRESETS
    assert specdec.load_policy is load_policy


def test_presets():
    assert set(PRESETS) >= {"none", "copy", "ngram", "draft"}
    assert PRESETS["none"].drafters == ()
    assert PRESETS["copy"].drafters == ("ngram_copy",)
    assert PRESETS["copy"].governor == "copy_governor"
    assert PRESETS["ngram"].drafters == ("ngram_copy",)
    assert PRESETS["ngram"].governor is None
    assert PRESETS["draft"].drafters == ("draft_model",)
    for name, policy in PRESETS.items():
        assert policy.name == name
        assert load_policy(name) is policy


def test_load_policy_none_is_plain_decoding():
    assert load_policy(None) == PRESETS["none"]


def test_load_policy_passes_a_policy_through():
    p = Policy(drafters=("a",))
    assert load_policy(p) is p


def test_unknown_preset_lists_the_presets():
    with pytest.raises(PolicyError) as excinfo:
        load_policy("fastest")
    message = str(excinfo.value)
    assert "fastest" in message
    for name in PRESETS:
        assert name in message


def test_load_policy_rejects_other_types():
    with pytest.raises(PolicyError, match="preset name"):
        load_policy(42)


# -- Python form ----------------------------------------------------------------


def test_a_single_drafter_name_becomes_a_tuple():
    assert Policy(drafters="ngram_copy").drafters == ("ngram_copy",)
    assert Policy(drafters=["a", "b"]).drafters == ("a", "b")
    assert Policy(drafters=None).drafters == ()


def test_frozen():
    p = Policy()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.max_block = 4


def test_with_options_and_options_for():
    p = Policy(drafters=("a",), options={"a": {"k": 1}})
    q = p.with_options("a", k=2, j=3).with_options("b", x=True)
    assert p.options == {"a": {"k": 1}}  # the original is unchanged
    assert q.options_for("a") == {"k": 2, "j": 3}
    assert q.options_for("b") == {"x": True}
    assert q.options_for("missing") == {}
    q.options_for("a")["k"] = 99  # a fresh dict each time
    assert q.options_for("a")["k"] == 2


def test_equal_policies_hash_alike():
    a = Policy(drafters=("x",), options={"x": {"n": 1}})
    b = Policy(drafters=("x",), options={"x": {"n": 1}})
    assert a == b
    assert hash(a) == hash(b)
    assert a != Policy(drafters=("x",), options={"x": {"n": 2}})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"drafters": ("a", "a")}, "twice"),
        ({"drafters": ("a", "")}, "drafters"),
        ({"drafters": (1,)}, "drafters"),
        ({"drafters": 5}, "drafters"),
        ({"governor": ""}, "governor"),
        ({"governor": 3}, "governor"),
        ({"acceptor": ""}, "acceptor"),
        ({"verifier": None}, "verifier"),
        ({"rollback": ""}, "rollback"),
        ({"name": ""}, "name"),
        ({"max_block": 0}, "max_block"),
        ({"max_block": -3}, "max_block"),
        ({"max_block": 2.5}, "max_block"),
        ({"max_block": "8"}, "max_block"),
        ({"max_block": True}, "max_block"),
        ({"min_block": 0}, "min_block"),
        ({"min_block": 5, "max_block": 4}, "min_block"),
        ({"options": ["a"]}, "options"),
        ({"options": {"a": 1}}, "options for 'a'"),
    ],
)
def test_bad_values(kwargs, match):
    with pytest.raises(PolicyError, match=match):
        Policy(**kwargs)
    with pytest.raises(PolicyError, match=match):
        Policy.from_dict(kwargs)


def test_policy_errors_are_value_errors():
    with pytest.raises(ValueError):
        Policy(max_block=0)


# -- dict form ------------------------------------------------------------------


def test_from_dict():
    p = Policy.from_dict(
        {
            "name": "mine",
            "drafters": ["ngram_copy", "draft_model"],
            "governor": "copy_governor",
            "acceptor": "greedy",
            "rollback": "auto",
            "max_block": 8,
            "min_block": 2,
            "options": {"ngram_copy": {"min_n": 2}},
        }
    )
    assert p.name == "mine"
    assert p.drafters == ("ngram_copy", "draft_model")
    assert p.governor == "copy_governor"
    assert p.acceptor == "greedy"
    assert (p.max_block, p.min_block) == (8, 2)
    assert p.options_for("ngram_copy") == {"min_n": 2}
    assert load_policy({"drafters": ["ngram_copy"]}).drafters == ("ngram_copy",)


def test_unknown_keys_are_named_with_the_accepted_ones():
    with pytest.raises(PolicyError) as excinfo:
        Policy.from_dict({"drafters": ["a"], "block_size": 4, "acceptr": "greedy"})
    message = str(excinfo.value)
    assert "block_size" in message and "acceptr" in message
    for field in Policy.FIELDS:
        assert field in message


def test_from_dict_needs_a_mapping():
    with pytest.raises(PolicyError, match="mapping"):
        Policy.from_dict(["drafters"])


def test_fields_lists_every_attribute():
    assert set(Policy.FIELDS) == {f.name for f in attrs.fields(Policy)}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_presets(name):
    p = PRESETS[name]
    assert Policy.from_dict(p.to_dict()) == p


def test_round_trip_custom():
    p = Policy(
        name="rt",
        drafters=("a", "b"),
        governor="g",
        acceptor="rejection",
        verifier="hidden",
        rollback="kv_trim",
        max_block=12,
        min_block=3,
        options={"a": {"x": [1, 2]}, "g": {"patience": 4}},
    )
    d = p.to_dict()
    assert d["drafters"] == ["a", "b"]
    assert Policy.from_dict(d) == p
    assert load_policy(d) == p


# -- TOML form ------------------------------------------------------------------

TOML = """\
drafters = ["ngram_copy"]
governor = "copy_governor"
acceptor = "auto"
verifier = "logits"
rollback = "auto"
max_block = 12

[options.ngram_copy]
min_n = 2
"""


def test_from_toml(tmp_path):
    path = tmp_path / "fast-copy.toml"
    path.write_text(TOML)
    p = Policy.from_toml(path)
    assert p.name == "fast-copy"  # the file's stem when the file has no name
    assert p.drafters == ("ngram_copy",)
    assert p.governor == "copy_governor"
    assert p.max_block == 12
    assert p.options == {"ngram_copy": {"min_n": 2}}
    assert load_policy(str(path)) == p
    assert load_policy(path) == p


def test_toml_name_wins_over_file_stem(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('name = "named"\n' + TOML)
    assert Policy.from_toml(path).name == "named"


def test_toml_round_trip(tmp_path):
    p = Policy(name="rt", drafters=("a",), max_block=4, options={"a": {"k": 1, "s": "v"}})
    lines = [
        f'name = "{p.name}"',
        f"drafters = {list(p.drafters)!r}".replace("'", '"'),
        f"max_block = {p.max_block}",
        "[options.a]",
        "k = 1",
        's = "v"',
    ]
    path = tmp_path / "rt.toml"
    path.write_text("\n".join(lines) + "\n")
    assert Policy.from_toml(path) == p


def test_malformed_toml(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('drafters = ["ngram_copy"\nmax_block = 8\n')
    with pytest.raises(PolicyError) as excinfo:
        load_policy(str(path))
    message = str(excinfo.value)
    assert "broken.toml" in message
    assert "not valid TOML" in message


def test_toml_with_unknown_key(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('drafter = "ngram_copy"\n')
    with pytest.raises(PolicyError, match="drafter"):
        Policy.from_toml(path)


def test_toml_with_bad_value(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("max_block = 0\n")
    with pytest.raises(PolicyError, match="max_block"):
        load_policy(path)


def test_missing_toml_file(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(str(tmp_path / "nope.toml"))


def test_option_checks_name_the_component_the_option_and_what_is_accepted():
    import specdec
    from specdec.options import bool_option, fraction_option, int_option, reject_unknown

    reject_unknown("c", {"a": 1}, ["a", "b"])
    with pytest.raises(
        PolicyError, match=r"c: unknown option\(s\) \['z'\]; accepted options are \['a', 'b'\]"
    ):
        reject_unknown("c", {"z": 1, "a": 2}, ("b", "a"))
    assert int_option("c", "n", 3, 1) == 3
    for bad in (0, True, 2.0, "3"):
        with pytest.raises(PolicyError, match="c: option n must be an integer >= 1, got"):
            int_option("c", "n", bad, 1)
    assert fraction_option("c", "f", 1) == 1.0
    for bad in (-0.1, 1.5, False, "0.5"):
        with pytest.raises(PolicyError, match=r"c: option f must be a number in \[0, 1\]"):
            fraction_option("c", "f", bad)
    assert bool_option("c", "b", False) is False
    with pytest.raises(PolicyError, match="c: option b must be true or false, got 1"):
        bool_option("c", "b", 1)
    assert specdec.options.reject_unknown is reject_unknown
