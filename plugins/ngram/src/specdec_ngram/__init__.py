"""specdec-plugin-ngram: the ``ngram_copy`` drafter for specdec.

Copies blocks from the context: where the last few committed tokens occurred
before (in the prompt, or also in the output), it proposes what followed there.
Install the distribution and name the drafter in a policy::

    import specdec
    pipe = specdec.assemble(model, policy=specdec.Policy(drafters=("ngram_copy",)))

or use the ``copy`` preset (with ``specdec-plugin-copy-governor``).
"""

from __future__ import annotations

from .cursor import CopyCursor, EditRule
from .drafter import DEFAULTS, NgramCopyDrafter, NgramCopySession, create_ngram_copy
from .index import NgramIndex, NgramMatch
from .store import CopyStore, CopyStoreError, StoreMatch

__version__ = "0.4.3"

__all__ = [
    "DEFAULTS",
    "CopyCursor",
    "CopyStore",
    "CopyStoreError",
    "EditRule",
    "NgramCopyDrafter",
    "NgramCopySession",
    "NgramIndex",
    "NgramMatch",
    "StoreMatch",
    "create_ngram_copy",
]
