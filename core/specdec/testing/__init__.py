"""The specdec test kit for plugin authors (also a pytest plugin: fixtures in :mod:`.pytest_plugin`).

Typical use in a plugin's tests::

    import specdec
    from specdec.testing import make_tiny_model, copy_heavy_prompt, check_greedy_identity

    model = make_tiny_model("gemma3")
    prompt = copy_heavy_prompt(model, [1, 2, 3, 4, 5])
    check_greedy_identity(model, specdec.Policy(drafters=("my_drafter",)), prompt)
"""

from __future__ import annotations

from .checks import (
    cache_view,
    check_caches_match_plain,
    check_fewer_forwards,
    check_greedy_identity,
    check_sampled_distribution,
    check_sampled_identity,
    chi_square_p_value,
    copy_heavy_prompt,
    plain_greedy,
    plugin_host,
)
from .models import ARCHITECTURES, make_tiny_model, tiny_model_args
from .oracle import CORRUPTIONS, OracleDrafter, oracle_plugin
from .toy_tokenizer import ToyTokenizer

__all__ = [
    "ARCHITECTURES",
    "ToyTokenizer",
    "CORRUPTIONS",
    "OracleDrafter",
    "cache_view",
    "check_caches_match_plain",
    "check_fewer_forwards",
    "check_greedy_identity",
    "check_sampled_distribution",
    "check_sampled_identity",
    "chi_square_p_value",
    "copy_heavy_prompt",
    "make_tiny_model",
    "oracle_plugin",
    "plain_greedy",
    "plugin_host",
    "tiny_model_args",
]
