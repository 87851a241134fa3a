"""What an assistant step costs against the target's own steps, on this machine.

For the plugin README, or by hand::

    python -m specdec_gemma4_mtp costs --model PATH --assistant PATH
    python -m specdec_gemma4_mtp costs --random-weights e2b     # Gemma 4 E2B shapes, bf16

After a prefill of ``--context`` random tokens, four things are timed interleaved
(round robin, ``--reps`` times each, medians), every one evaluated to the end:

- ``target_step``: one decode forward of the target (one token), logits included;
- ``verify``: one verify forward of ``[last, *block]`` (``--block`` drafts);
- ``assistant_step``: one draft step of the assistant (its layers over the target's
  K/V and its output layer: the centroid-masked one where it has it);
- ``assistant_step_dense``: the same with the whole tied head;
- ``head_rows``: the target's output layer alone over the verify's ``block + 1``
  hidden rows, and ``head_row``: over one row (what projecting the verify's logits
  position by position, stopping at the first rejection, would cost per position).

The target's caches are trimmed back after each forward, so the context stays put.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import specdec

from .assistant import AssistantConfig, Gemma4Assistant
from .target import TargetBinding, bind_target

#: Gemma 4 E2B (``google/gemma-4-E2B-it``'s text config) and its assistant's shapes.
E2B_TARGET = dict(
    model_type="gemma4_text",
    hidden_size=1536,
    num_hidden_layers=35,
    intermediate_size=6144,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    hidden_size_per_layer_input=256,
    vocab_size=262144,
    vocab_size_per_layer_input=262144,
    num_kv_shared_layers=20,
    sliding_window=512,
    sliding_window_pattern=5,
    final_logit_softcapping=30.0,
    use_double_wide_mlp=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
)
E2B_ASSISTANT = {
    "model_type": "gemma4_assistant",
    "backbone_hidden_size": 1536,
    "use_ordered_embeddings": True,
    "num_centroids": 2048,
    "centroid_intermediate_top_k": 32,
    "text_config": {
        "hidden_size": 256,
        "intermediate_size": 2048,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "head_dim": 256,
        "global_head_dim": 512,
        "sliding_window": 512,
        "vocab_size": 262144,
        "rms_norm_eps": 1e-6,
    },
}


def random_e2b(
    dtype: Any = mx.float32, seed: int = 0, per_layer_vocab: int = 4096
) -> tuple[Any, Gemma4Assistant]:
    """A random-weight Gemma 4 E2B text model and a random E2B-shaped assistant.

    ``per_layer_vocab``: rows of the per-layer-input table (E2B's has 262,144 rows of
    35 x 256: 9.4 GB in float32); a lookup, whose size changes no timing. Float32 by
    default: MLX's bfloat16 matmuls on a CPU do not use the BLAS and are many times
    slower.
    """
    from mlx.utils import tree_map
    from mlx_lm.models import gemma4_text

    mx.random.seed(seed)
    cfg = dict(E2B_TARGET, vocab_size_per_layer_input=per_layer_vocab)
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(cfg))
    for layer in model.model.layers:  # layer by layer: bounded peak memory
        layer.update(tree_map(lambda p: p.astype(dtype), layer.parameters()))
        mx.eval(layer.parameters())
    rest = {k: v for k, v in model.model.parameters().items() if k != "layers"}
    model.model.update(tree_map(lambda p: p.astype(dtype), rest))
    mx.eval(model.parameters())
    model.eval()
    asst = Gemma4Assistant(AssistantConfig.from_dict(E2B_ASSISTANT))
    ordering = asst.masked_embedding.token_ordering
    asst.update(tree_map(lambda p: (p * 0.02).astype(dtype), asst.parameters()))
    asst.masked_embedding.token_ordering = mx.random.permutation(ordering.size).astype(mx.int32)
    mx.eval(asst.parameters())
    asst.eval()
    return model, asst


def _median_ms(fn: Callable[[], Any], times: list) -> None:
    t0 = time.perf_counter()
    mx.eval(fn())
    times.append((time.perf_counter() - t0) * 1e3)


def measure_step_costs(
    model: Any,
    assistant: Gemma4Assistant,
    *,
    binding: TargetBinding | None = None,
    context: int = 512,
    block: int = 3,
    reps: int = 10,
    seed: int = 0,
) -> dict:
    """Interleaved medians (ms) of a target step, a verify forward, an assistant step
    (masked and dense), and the target's output layer over ``block + 1`` rows and one row.

    Returns:
        the medians, their ratios to ``target_step`` and what was measured.
    """
    from mlx_lm.models.cache import make_prompt_cache

    binding = binding or bind_target(model, assistant.config)
    cfg = assistant.config
    vocab = binding.vocab_size
    import random

    rng = random.Random(seed)
    # ids the per-layer-input table has rows for (random_e2b cuts it; ids cost the same)
    per_layer = getattr(getattr(model, "args", None), "vocab_size_per_layer_input", None)
    top = min(vocab, per_layer or vocab)
    prompt = [rng.randrange(top) for _ in range(context)]
    caches = make_prompt_cache(model)
    taps = specdec.capture.model_taps(model)
    with taps.recording() as rec:
        out = model(mx.array(prompt)[None], cache=caches)
    h = rec["hidden"][:, -1:]
    mx.eval(out, h, [c.state for c in caches])
    layer = specdec.heads.output_layer(model)
    plan = specdec.rollback_plan(caches, model=model)
    types = cfg.layer_types
    ropes = {t: binding.donors[t].rope for t in set(types)}
    scales = {t: binding.donors[t].scale for t in set(types)}
    tok = mx.array([[prompt[-1]]])
    blk = mx.array([prompt[-block - 1 :]])
    rows = mx.random.normal((block + 1, binding.hidden_size)).astype(h.dtype)

    def forward(x: mx.array) -> Any:
        txn = plan.begin()
        y = model(x, cache=caches)
        mx.eval(y)
        txn.commit(x.shape[1], 0)
        return y

    def step(masked: bool) -> Any:
        kv = binding.kv(caches, types)
        emb = binding.embed_tokens(tok[0])[None]
        n, nxt = assistant.hidden(emb, h, kv, ropes, context, scales)
        return assistant.logits(n[0], masked=masked), nxt

    jobs = {
        "target_step": lambda: forward(tok),
        "verify": lambda: forward(blk),
        "assistant_step": lambda: step(True),
        "assistant_step_dense": lambda: step(False),
        "head_rows": lambda: layer.logits(rows),
        "head_row": lambda: layer.logits(rows[:1]),
    }
    if not cfg.use_ordered_embeddings:
        del jobs["assistant_step_dense"]
    for fn in jobs.values():  # warm up
        mx.eval(fn())
    times: dict[str, list] = {k: [] for k in jobs}
    for _ in range(reps):
        for k, fn in jobs.items():
            _median_ms(fn, times[k])
    med = {k: round(statistics.median(v), 3) for k, v in times.items()}
    base = med["target_step"]
    return {
        "ms": med,
        "fraction_of_target_step": {k: round(v / base, 3) for k, v in med.items()},
        "context": context,
        "block": block,
        "reps": reps,
        "dtype": str(rows.dtype).replace("mlx.core.", ""),
        "assistant": {
            "hidden_size": cfg.hidden_size,
            "layers": list(cfg.layer_types),
            "logits": "centroids" if cfg.use_ordered_embeddings else "dense",
            "params": assistant.n_params(),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specdec_gemma4_mtp costs ...``: print the measurement as JSON."""
    p = argparse.ArgumentParser(prog="python -m specdec_gemma4_mtp costs")
    p.add_argument("--model", default=None, help="target model folder (default: the default model)")
    p.add_argument("--assistant", default=None, help="assistant checkpoint folder")
    p.add_argument(
        "--random-weights",
        choices=("e2b",),
        default=None,
        help="random weights at the Gemma 4 E2B shapes (target and assistant, float32)",
    )
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--block", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if args.random_weights:
        model, asst = random_e2b()
    else:
        if not args.assistant:
            p.error("give --assistant (or --random-weights e2b)")
        from .checkpoint import load_assistant

        model = specdec.assemble(args.model, policy="none").model
        asst, _ = load_assistant(args.assistant)
    res = measure_step_costs(model, asst, context=args.context, block=args.block, reps=args.reps)
    print(json.dumps(res, indent=1))
    return 0


def measure_held_out(
    assistant: str,
    *,
    model: str | None = None,
    max_tokens: int = 128,
    depth: int = 3,
    **options: Any,
) -> dict:
    """Per-position acceptance of an assistant ``specdec train-assistant`` wrote, drafting
    greedily on the prompts its training held out (``train_data.json``), at a fixed depth
    (``options``: further ``gemma4_mtp`` options, e.g. ``centroids="off"``): specdec-train's
    :func:`specdec_train.held_out_acceptance` with the ``gemma4`` preset.

    Raises:
        specdec_train.TrainError: ``train_data.json`` does not say which prompts
            were held out (written before core 0.2.7).
    """
    pol = specdec.load_policy("gemma4").with_options(
        "gemma4_mtp", assistant=str(assistant), depth=depth, adaptive=False, **options
    )
    import specdec_train

    return specdec_train.held_out_acceptance(
        assistant, pol, "gemma4_mtp", model=model, max_tokens=max_tokens
    )
