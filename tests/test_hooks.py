"""The plugin host: one ``test_hook_<name>`` per hook, then loading, conflicts and errors."""

from __future__ import annotations

import json

import importlib_metadata
import pytest
import specdec
from specdec import hookspecs
from specdec.errors import PluginConflictError, PolicyError, UnknownComponentError
from specdec.plugins import CORE_DISTRIBUTION, PROVIDES_GROUP, PluginHost, core_version
from specdec.roles import (
    Acceptance,
    Acceptor,
    BaseDrafter,
    BaseGovernor,
    CacheRollback,
    Draft,
    Drafter,
    Governor,
    Verifier,
    VerifyResult,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("SPECDEC_PLUGINS", raising=False)
    monkeypatch.delenv("SPECDEC_TRACE_PLUGINS", raising=False)


# -- fakes ---------------------------------------------------------------------


class FakeDist:
    """What the host reads from ``entry_point.dist``."""

    def __init__(self, name: str, version: str):
        self.name = name
        self.version = version
        self.metadata = {"Name": name}


class FakeEntryPoint:
    """An entry point of group ``specdec`` whose ``load()`` returns ``obj`` or raises ``error``."""

    group = "specdec"

    def __init__(self, name, obj=None, *, dist="specdec-plugin-fake", version="1.2.3", error=None):
        self.name = name
        self.value = f"{name}_module"
        self.dist = FakeDist(dist, version)
        self._obj = obj
        self._error = error
        self.loaded = False

    def load(self):
        self.loaded = True
        if self._error is not None:
            raise self._error
        return self._obj


def drafter_plugin(component: str):
    """A plugin object registering one drafter called ``component``."""

    class Plugin:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register(component, EchoDrafter, description=f"test drafter {component}")

    return Plugin()


def host_with(plugin, *, name="test-plugin", distribution="specdec-plugin-test", version="9.9"):
    """A fresh host without entry points, with ``plugin`` registered by hand."""
    host = PluginHost(load_entry_points=False)
    host.register_plugin(plugin, name=name, distribution=distribution, version=version)
    # register_plugin does not re-run the registration hooks; rebuild the tables
    # (as specdec.testing.plugin_host does).
    host.refresh()
    return host


def assert_registered(host, role, component, protocol, *, distribution="specdec-plugin-test"):
    info = host.components[role][component]
    assert info.role == role
    assert info.name == component
    assert info.plugin == "test-plugin"
    assert info.distribution == distribution
    assert info.version == "9.9"
    assert info.description == f"test {component}"
    assert component in host.names(role)
    assert host.get(role, component) is info
    obj = host.create(role, component, {"label": "x"})
    assert isinstance(obj, protocol)
    assert obj.label == "x"
    listed = {p["name"]: p for p in host.to_dict()["plugins"]}
    assert listed["test-plugin"]["components"] == {role: [component]}
    return obj


# -- components, one per role ---------------------------------------------------


class EchoDrafter(BaseDrafter):
    name = "echo"

    def __init__(self, label: str = ""):
        self.label = label

    def session(self, ctx):
        return EchoSession()


class EchoSession(specdec.BaseDrafterSession):
    def propose(self, history, max_len):
        return Draft(tokens=list(history[-max_len:])) if history else None


class PlainVerifier:
    name = "plain"
    provides = frozenset({"logits"})

    def __init__(self, label: str = ""):
        self.label = label

    def verify(self, model, tokens, caches):
        return VerifyResult(logits=model(tokens[None], cache=caches)[0])


class FirstTokenAcceptor:
    name = "first"

    def __init__(self, label: str = ""):
        self.label = label

    def accept(self, block, draft_probs, logits, sampler, positions):
        return Acceptance(n_accepted=0, token=int(logits[0].argmax()))


class NoTransaction:
    def commit(self, n_fed, n_keep):
        pass

    def abort(self):
        pass


class NothingRollback:
    name = "nothing"

    def __init__(self, label: str = ""):
        self.label = label

    def supports(self, cache):
        return False

    def begin(self, cache):
        return NoTransaction()


class HalfGovernor(BaseGovernor):
    name = "half"

    def __init__(self, label: str = ""):
        self.label = label

    def session(self, ctx):
        return HalfSession()


class HalfSession(specdec.BaseGovernorSession):
    def budget(self, drafter, max_len):
        return max_len // 2


class ExactishHead:
    name = "exactish"
    vocab_size = 64

    def __init__(self, label: str = ""):
        self.label = label

    def bind(self, model):
        pass

    def logits(self, hidden):
        return hidden

    def stats(self):
        return {}


# -- one test per hook ----------------------------------------------------------


def test_hook_specdec_register_drafters():
    class Plugin:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("t_drafter", EchoDrafter, description="test t_drafter")

    drafter = assert_registered(host_with(Plugin()), "drafter", "t_drafter", Drafter)
    session = drafter.session(None)
    assert isinstance(session, specdec.DrafterSession)
    assert session.propose([1, 2, 3], 2).tokens == (2, 3)


def test_hook_specdec_register_verifiers():
    class Plugin:
        @specdec.hookimpl
        def specdec_register_verifiers(self, register):
            register("t_verifier", PlainVerifier, description="test t_verifier")

    assert_registered(host_with(Plugin()), "verifier", "t_verifier", Verifier)


def test_hook_specdec_register_acceptors():
    class Plugin:
        @specdec.hookimpl
        def specdec_register_acceptors(self, register):
            register("t_acceptor", FirstTokenAcceptor, description="test t_acceptor")

    assert_registered(host_with(Plugin()), "acceptor", "t_acceptor", Acceptor)


def test_hook_specdec_register_cache_rollbacks():
    class Plugin:
        @specdec.hookimpl
        def specdec_register_cache_rollbacks(self, register):
            register("t_rollback", NothingRollback, description="test t_rollback")

    rollback = assert_registered(host_with(Plugin()), "cache_rollback", "t_rollback", CacheRollback)
    assert rollback.supports(object()) is False


def test_hook_specdec_register_governors():
    class Plugin:
        @specdec.hookimpl
        def specdec_register_governors(self, register):
            register("t_governor", HalfGovernor, description="test t_governor")

    governor = assert_registered(host_with(Plugin()), "governor", "t_governor", Governor)
    session = governor.session(None)
    assert isinstance(session, specdec.GovernorSession)
    assert session.budget("any", 8) == 4


def test_hook_specdec_register_draft_heads():
    class Plugin:
        @specdec.hookimpl
        def specdec_register_draft_heads(self, register):
            register("t_head", ExactishHead, description="test t_head")

    head = assert_registered(host_with(Plugin()), "draft_head", "t_head", specdec.DraftHead)
    assert head.vocab_size == 64


def test_hook_specdec_register_policies():
    class Plugin:
        @specdec.hookimpl
        def specdec_register_policies(self, register):
            register("t_preset", {"drafters": ["t_drafter"]}, description="test t_preset")
            register("t_obj", specdec.Policy(name="t_obj", max_block=4))

    host = host_with(Plugin())
    info = host.presets["t_preset"]
    assert info.distribution == "specdec-plugin-test" and info.description == "test t_preset"
    assert info.policy == specdec.Policy(name="t_preset", drafters=("t_drafter",))
    assert specdec.load_policy("t_obj", host=host).max_block == 4
    assert list(host.presets)[:2] == ["none", "draft"]  # the core's come first
    with pytest.raises(specdec.PolicyError, match=r"unknown policy 't_other'.*t_obj, t_preset"):
        specdec.load_policy("t_other", host=host)


def test_preset_registered_twice_or_misnamed_names_the_plugin():
    class Twice:
        @specdec.hookimpl
        def specdec_register_policies(self, register):
            register("none", {})

    with pytest.raises(
        PluginConflictError, match=r"preset 'none'.*specdec-core.*specdec-plugin-test"
    ):
        host_with(Twice())

    class Misnamed:
        @specdec.hookimpl
        def specdec_register_policies(self, register):
            register("mine", specdec.Policy(name="other"))

    with pytest.raises(PluginConflictError, match=r"plugin 'test-plugin'.*'mine'.*'other'"):
        host_with(Misnamed())


def test_registration_metadata_is_declared_read_from_classes_and_defaulted():
    def make(**options):
        return EchoDrafter(**options)

    class Batched(EchoDrafter):
        needs = frozenset({"hidden"})
        supports_batch = True

    class Plugin:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("given", make, needs=["kv"], supports_batch=True)
            register("from_class", Batched)
            register("function", make)

        @specdec.hookimpl
        def specdec_register_verifiers(self, register):
            register("v", PlainVerifier, provides={"logits", "hidden"})

    host = host_with(Plugin())
    drafters = host.components["drafter"]
    assert (drafters["given"].needs, drafters["given"].supports_batch) == ({"kv"}, True)
    assert drafters["from_class"].needs == {"hidden"} and drafters["from_class"].supports_batch
    assert (drafters["function"].needs, drafters["function"].supports_batch) == (set(), False)
    assert host.components["verifier"]["v"].provides == {"logits", "hidden"}
    assert host.components["verifier"]["logits"].provides == {"logits", "kv"}
    assert host.components["governor"] == {} or all(
        isinstance(c.supports_batch, bool) for c in host.components["governor"].values()
    )


@pytest.mark.parametrize(
    ("role_hook", "kwargs", "message"),
    [
        ("drafters", {"needs": ["telepathy"]}, r"needs=\['telepathy'\].*no verifier capabilities"),
        ("drafters", {"needs": "hidden"}, r"needs='hidden'.*expected a set of capabilities"),
        ("drafters", {"provides": ["logits"]}, r"provides=.*only verifiers declare provides"),
        ("drafters", {"supports_batch": "yes"}, r"supports_batch='yes'.*expected True or False"),
        (
            "acceptors",
            {"supports_batch": True},
            r"acceptor 'x'.*only drafters, verifiers, governors",
        ),
        ("verifiers", {"needs": ["hidden"]}, r"verifier 'x' with needs=.*only drafters declare"),
    ],
)
def test_bad_registration_metadata_names_the_plugin_and_the_argument(role_hook, kwargs, message):
    hook = f"specdec_register_{role_hook}"

    def impl(register):
        register("x", EchoDrafter, **kwargs)

    plugin = type("P", (), {hook: staticmethod(specdec.hookimpl(impl))})()
    with pytest.raises(PluginConflictError, match=r"plugin 'test-plugin' \(specdec-plugin-test\)"):
        host_with(plugin)
    with pytest.raises(PluginConflictError, match=message):
        host_with(plugin)


def test_every_hook_has_a_role():
    # The host maps each registration hook to a role table; a new one needs a new role.
    # specdec_register_commands is the CLI's (specdec.cli), specdec_register_policies
    # the presets' (host.presets), not a role's.
    from specdec.plugins import _HOOK_BY_ROLE

    hooks = {n for n in dir(hookspecs) if n.startswith("specdec_")}
    assert (
        hooks - {"specdec_register_commands", "specdec_register_policies"}
        == set(_HOOK_BY_ROLE.values())
        == {
            "specdec_register_drafters",
            "specdec_register_verifiers",
            "specdec_register_acceptors",
            "specdec_register_cache_rollbacks",
            "specdec_register_governors",
            "specdec_register_draft_heads",
        }
    )
    assert "specdec_register_commands" in hooks


def test_plugin_module_with_several_hooks():
    import types

    module = types.ModuleType("specdec_two_roles")

    @specdec.hookimpl
    def specdec_register_drafters(register):
        register("m_drafter", EchoDrafter)

    @specdec.hookimpl
    def specdec_register_governors(register):
        register("m_governor", HalfGovernor)

    module.specdec_register_drafters = specdec_register_drafters
    module.specdec_register_governors = specdec_register_governors
    host = host_with(module)
    assert host.components["drafter"]["m_drafter"].description == ""
    assert host.components["governor"]["m_governor"].plugin == "test-plugin"


def test_builtins_register_through_the_same_hooks():
    host = PluginHost(load_entry_points=False)
    assert [p.distribution for p in host.plugins] == [CORE_DISTRIBUTION]
    for role, table in host.components.items():
        for info in table.values():
            assert info.distribution == CORE_DISTRIBUTION, (role, info.name)
    assert "draft_model" in host.components["drafter"]
    assert "logits" in host.components["verifier"]


# -- entry-point loading ---------------------------------------------------------


def test_entry_point_plugin_is_loaded():
    ep = FakeEntryPoint("fake_one", drafter_plugin("ep_drafter"))
    host = PluginHost(entry_points=[ep])
    info = host.components["drafter"]["ep_drafter"]
    assert (info.plugin, info.distribution, info.version) == (
        "fake_one",
        "specdec-plugin-fake",
        "1.2.3",
    )
    assert not host.failures


def test_broken_plugin_is_skipped_and_recorded(capsys):
    broken = FakeEntryPoint(
        "broken_one", dist="specdec-plugin-broken", version="0.0.7", error=ImportError("no mlx_foo")
    )
    good = FakeEntryPoint("good_one", drafter_plugin("good_drafter"))
    host = PluginHost(entry_points=[broken, good])

    assert broken.loaded
    assert "good_drafter" in host.components["drafter"]  # the rest still loads
    assert len(host.failures) == 1
    failure = host.failures[0]
    assert failure.entry_point == "broken_one"
    assert failure.distribution == "specdec-plugin-broken"
    assert failure.version == "0.0.7"
    assert failure.core_version == core_version()
    assert "ImportError" in failure.error and "no mlx_foo" in failure.error

    err = capsys.readouterr().err
    assert "broken_one" in err and "specdec-plugin-broken" in err and "0.0.7" in err

    data = json.loads(json.dumps(host.to_dict()))
    assert data["failures"][0]["entry_point"] == "broken_one"
    assert data["failures"][0]["core_version"] == core_version()


def test_same_component_from_two_distributions_is_a_conflict():
    a = FakeEntryPoint("plugin_a", drafter_plugin("shared_name"), dist="specdec-plugin-aaa")
    b = FakeEntryPoint("plugin_b", drafter_plugin("shared_name"), dist="specdec-plugin-bbb")
    with pytest.raises(PluginConflictError) as excinfo:
        PluginHost(entry_points=[a, b])
    message = str(excinfo.value)
    assert "shared_name" in message
    assert "specdec-plugin-aaa" in message and "specdec-plugin-bbb" in message


def test_registering_a_builtin_name_is_a_conflict():
    with pytest.raises(PluginConflictError) as excinfo:
        host_with(drafter_plugin("draft_model"), distribution="specdec-plugin-clash")
    assert CORE_DISTRIBUTION in str(excinfo.value)
    assert "specdec-plugin-clash" in str(excinfo.value)


def test_same_plugin_name_twice_is_a_conflict():
    a = FakeEntryPoint("same_ep", drafter_plugin("x1"), dist="specdec-plugin-aaa")
    b = FakeEntryPoint("same_ep", drafter_plugin("x2"), dist="specdec-plugin-bbb")
    with pytest.raises(PluginConflictError) as excinfo:
        PluginHost(entry_points=[a, b])
    assert "specdec-plugin-aaa" in str(excinfo.value)
    assert "specdec-plugin-bbb" in str(excinfo.value)


def test_invalid_hookimpl_names_the_distribution():
    class Plugin:
        @specdec.hookimpl
        def specdec_register_drafters(self, registrar):  # the spec's argument is `register`
            pass

    host = PluginHost(load_entry_points=False)
    with pytest.raises(PluginConflictError) as excinfo:
        host.register_plugin(Plugin(), name="bad-plugin", distribution="specdec-plugin-bad")
    message = str(excinfo.value)
    assert "specdec-plugin-bad" in message
    assert "registrar" in message


def test_bad_register_calls_are_errors():
    class NoName:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("", EchoDrafter)

    class NotCallable:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("not_callable", 42)

    with pytest.raises(PluginConflictError, match="specdec-plugin-test"):
        host_with(NoName())
    with pytest.raises(PluginConflictError, match="not callable"):
        host_with(NotCallable())


# -- environment ---------------------------------------------------------------


def test_specdec_plugins_empty_loads_no_third_party_plugin(monkeypatch):
    monkeypatch.setenv("SPECDEC_PLUGINS", "")
    ep = FakeEntryPoint("fake_one", drafter_plugin("ep_drafter"))
    host = PluginHost(entry_points=[ep])
    assert not ep.loaded
    assert "ep_drafter" not in host.components["drafter"]
    assert {p.distribution for p in host.plugins} == {CORE_DISTRIBUTION}

    # Also with the real entry points of whatever is installed.
    host = PluginHost()
    assert {p.distribution for p in host.plugins} == {CORE_DISTRIBUTION}
    for table in host.components.values():
        assert {i.distribution for i in table.values()} <= {CORE_DISTRIBUTION}


def test_specdec_plugins_is_an_allow_list(monkeypatch):
    monkeypatch.setenv("SPECDEC_PLUGINS", " specdec-plugin-aaa , specdec-plugin-ccc")
    a = FakeEntryPoint("plugin_a", drafter_plugin("from_a"), dist="specdec-plugin-aaa")
    b = FakeEntryPoint("plugin_b", drafter_plugin("from_b"), dist="specdec-plugin-bbb")
    host = PluginHost(entry_points=[a, b])
    assert a.loaded and not b.loaded
    assert "from_a" in host.components["drafter"]
    assert "from_b" not in host.components["drafter"]


def test_specdec_trace_plugins_prints_hook_calls(monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_TRACE_PLUGINS", "1")
    PluginHost(entry_points=[FakeEntryPoint("fake_one", drafter_plugin("ep_drafter"))])
    err = capsys.readouterr().err
    for hook in (
        "specdec_register_drafters",
        "specdec_register_verifiers",
        "specdec_register_acceptors",
        "specdec_register_cache_rollbacks",
        "specdec_register_governors",
    ):
        assert hook in err
    assert "fake_one" in err and "specdec-plugin-fake" in err


def test_no_trace_by_default(capsys):
    PluginHost(load_entry_points=False)
    assert "specdec trace" not in capsys.readouterr().err


# -- lookups -------------------------------------------------------------------


def test_unknown_component_lists_installed_ones():
    host = host_with(drafter_plugin("mine"))
    with pytest.raises(UnknownComponentError) as excinfo:
        host.get("drafter", "no_such_drafter")
    message = str(excinfo.value)
    assert "no_such_drafter" in message
    for name in host.names("drafter"):
        assert name in message
    assert isinstance(excinfo.value, PolicyError)


# What the installed distributions declare they provide (entry-point group specdec_provides).
DECLARED = {ep.name: ep.dist.name for ep in importlib_metadata.entry_points(group=PROVIDES_GROUP)}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_unknown_known_component_names_its_distribution(name):
    host = PluginHost(load_entry_points=False)
    role = next(r for r in host.components if name not in host.components[r])
    with pytest.raises(UnknownComponentError) as excinfo:
        host.get(role, name)
    assert DECLARED[name] in str(excinfo.value) and "not loaded" in str(excinfo.value)


def test_ngram_copy_not_installed_names_specdec_plugin_ngram():
    host = PluginHost(load_entry_points=False)
    with pytest.raises(UnknownComponentError, match="specdec-plugin-ngram"):
        host.get("drafter", "ngram_copy")


def test_component_of_another_role_is_named():
    host = PluginHost(load_entry_points=False)
    with pytest.raises(UnknownComponentError, match="verifier"):
        host.get("drafter", "logits")


def test_bad_options_are_policy_errors():
    host = host_with(drafter_plugin("opt_drafter"))
    with pytest.raises(PolicyError) as excinfo:
        host.create("drafter", "opt_drafter", {"no_such_option": 1})
    assert "opt_drafter" in str(excinfo.value)
    assert "specdec-plugin-test" in str(excinfo.value)


# -- the process-wide host -------------------------------------------------------


def test_process_wide_host_can_be_reset():
    original = specdec.get_plugin_host()
    try:
        assert specdec.get_plugin_host() is original
        assert specdec.plugins.get_plugin_manager() is original.pm
        replacement = PluginHost(load_entry_points=False)
        specdec.plugins.reset_plugin_host(replacement)
        assert specdec.get_plugin_host() is replacement
        specdec.plugins.reset_plugin_host()
        fresh = specdec.get_plugin_host()
        assert fresh is not replacement and fresh is not original
    finally:
        specdec.plugins.reset_plugin_host(original)
