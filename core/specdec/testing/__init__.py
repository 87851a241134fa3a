"""The specdec test kit for plugin authors (also a pytest plugin: fixtures in :mod:`.pytest_plugin`).

Typical use in a plugin's tests::

    import specdec
    from specdec.testing import make_tiny_model, copy_heavy_prompt, check_greedy_identity

    model = make_tiny_model("gemma3")
    prompt = copy_heavy_prompt(model, [1, 2, 3, 4, 5])
    check_greedy_identity(model, specdec.Policy(drafters=("my_drafter",)), prompt)

Every check that runs speculation asserts, unless called with ``require_drafts=False``,
that drafts were proposed and accepted; the plain reference is the pipeline users
get with the ``none`` policy. An entry-point test calls
``require_installed("my-distribution")``: it skips in a source tree, fails under CI.
"""

from __future__ import annotations

from .checks import (
    BATCH_TIE_GAP,
    cache_view,
    check_batch_identity,
    check_caches_match_plain,
    check_fewer_forwards,
    check_greedy_identity,
    check_listed,
    check_sampled_distribution,
    check_sampled_identity,
    chi_square_p_value,
    copy_heavy_prompt,
    find_copy_prompt,
    greedy_sequences,
    in_ci,
    plain_greedy,
    plugin_host,
    require_command,
    require_installed,
    skip_unless_ci,
)
from .faults import FAULTS, FaultOutcome, InjectedFault, check_drafter_faults
from .models import (
    ALL_ARCHITECTURES,
    ARCHITECTURES,
    EXTRA_ARCHITECTURES,
    make_tiny_model,
    tiny_model_args,
)
from .oracle import CORRUPTIONS, OracleDrafter, oracle_plugin
from .ranks import run_ranks
from .sessions import feed_round, request_context
from .toy_tokenizer import ToyTokenizer

__all__ = [
    "ALL_ARCHITECTURES",
    "ARCHITECTURES",
    "EXTRA_ARCHITECTURES",
    "ToyTokenizer",
    "CORRUPTIONS",
    "FAULTS",
    "FaultOutcome",
    "InjectedFault",
    "check_drafter_faults",
    "OracleDrafter",
    "BATCH_TIE_GAP",
    "cache_view",
    "check_batch_identity",
    "check_caches_match_plain",
    "check_fewer_forwards",
    "check_greedy_identity",
    "check_listed",
    "check_sampled_distribution",
    "check_sampled_identity",
    "chi_square_p_value",
    "copy_heavy_prompt",
    "feed_round",
    "find_copy_prompt",
    "greedy_sequences",
    "in_ci",
    "make_tiny_model",
    "oracle_plugin",
    "plain_greedy",
    "plugin_host",
    "request_context",
    "run_ranks",
    "require_command",
    "require_installed",
    "skip_unless_ci",
    "tiny_model_args",
]
