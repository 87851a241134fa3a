"""``ngram_copy`` under a grammar (``Request.grammar``): a value copied from the prompt
follows the key the grammar forced in the same block, and the output is constrained
plain decoding's."""

from __future__ import annotations

import json

import pytest
import specdec
from specdec.testing import check_greedy_identity

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "publisher": {"type": "string"},
    },
    "required": ["title", "author", "publisher"],
    "additionalProperties": False,
}
DOC = (
    "Catalogue entry: The Remarkable Voyage of the Northern Lighthouse Keeper, written by "
    "Margaret Ellington-Whitfield, published by Harborview Academic Press of Edinburgh."
)
POLICY = specdec.Policy(
    name="ngram-ladder", drafters=("ngram_copy",), options={"ngram_copy": {"sizing": "ladder"}}
)


@pytest.fixture(scope="module")
def smollm2():
    from mlx_lm import load
    from specdec.models import default_model_path

    return load(str(default_model_path()))


def test_copied_values_follow_forced_keys(smollm2):
    model, tok = smollm2
    msgs = [{"role": "user", "content": f"Give title, author and publisher as JSON.\n\n{DOC}"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
    grammar = {"json_schema": SCHEMA}
    rounds = []
    pipe = specdec.assemble(model, tok, POLICY)
    out = list(
        pipe.stream(prompt, max_tokens=80, grammar=grammar, on_round=lambda r, c: rounds.append(r))
    )
    text = "".join(r.text for r in out)
    assert set(json.loads(text)) == {"title", "author", "publisher"}
    mixed = [r for r in rounds if r.forced and r.drafter == "ngram_copy"]
    assert any(r.n_accepted > r.forced for r in mixed), [
        (r.drafter, r.forced, len(r.block), r.n_accepted) for r in rounds
    ]
    stats = out[-1].stats
    assert stats.per_drafter["ngram_copy"]["accepted"] > 0 and stats.grammar["forced"] > 0
    tot = check_greedy_identity(
        model, POLICY, prompt, tokenizer=tok, max_tokens_list=[1, 7, 30, 80], grammar=grammar
    )
    assert tot["target_forwards"] < tot["plain_forwards"]
