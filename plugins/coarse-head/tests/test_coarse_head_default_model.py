"""coarse_head on the real default model (SmolLM2-135M, float32, tied 49,152 x 576 head)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
import specdec
from mlx_lm.models.cache import make_prompt_cache
from specdec.cli import main
from specdec_coarse_head import create_coarse_head

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening to light the lamp. "
    "Ships passing the rocky coast relied on its beam to find the harbour safely. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
)


@pytest.fixture(scope="module")
def smollm2():
    pipe = specdec.assemble(None, policy="none")  # the built-in default model
    return pipe.model, pipe.tokenizer


@pytest.fixture(scope="module")
def states(smollm2):
    model, tok = smollm2
    ids = tok.encode(TEXT)
    taps = specdec.capture.model_taps(model)
    with taps.recording() as rec:
        logits = model(mx.array(ids)[None], cache=make_prompt_cache(model))
    return ids, rec["hidden"][0], mx.argmax(logits[0], axis=-1)


def test_rescored_candidates_are_the_full_heads_logits(smollm2, states):
    model, _ = smollm2
    _, hidden, _ = states
    ol = specdec.heads.output_layer(model)
    assert ol.tied and ol.vocab_size == 49152 and ol.post is None
    ids = mx.array(list(range(0, 49152, 768)))  # 64 rows across the vocabulary
    for i in (0, 7, 20):
        h = hidden[i : i + 1]
        full = specdec.capture.model_taps(model).head(h[None])[0].astype(mx.float32)
        # the same products summed by a narrower matmul: BLAS orders the sums by the
        # shape, so equal within float32 rounding (measured: |diff| <= 1.2e-5 here)
        diff = float(mx.max(mx.abs(ol.rows(h, ids) - full[:, ids])))
        assert diff <= 5e-5 * (1 + float(mx.max(mx.abs(full))) / 10), diff


@pytest.mark.parametrize("kind", ["quant", "pruned"])
def test_argmax_agreement_on_real_hidden_states(smollm2, states, kind):
    model, tok = smollm2
    ids, hidden, ref = states
    head = create_coarse_head(kind=kind)
    head.bind(model, tokenizer=tok)
    n = hidden.shape[0]
    got = [
        int(mx.argmax(head.logits(hidden[i : i + 1], context=ids[: i + 1]), -1).item())
        for i in range(n)
    ]
    agree = sum(g == r for g, r in zip(got, ref.tolist())) / n
    # the measured figure (README) is >= 99% on held-out answers; this text is short
    assert agree >= 0.95, agree
    if kind == "pruned":
        st = head.stats()["pruned"]
        assert st["rows"] == 16384 and st["corpus_tokens"] > 100_000 and st["context_variants"]


def test_doctor_reports_what_auto_chose(capsys):
    rc = main(["doctor", "--model", "default", "--head", "coarse_head", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    (h,) = json.loads(out)["heads"]
    st = h["stats"]
    assert h["head"] == "coarse_head" and st["kind"] == "auto"
    assert set(st["timings_ms"]) == {"full", "quant", "pruned"}
    assert st["chosen"] in ("full", "quant", "pruned") and st["why"]
    assert st["extra_bytes"] >= 0 and st["bind_s"] > 0
