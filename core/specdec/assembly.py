"""Building a pipeline: :func:`assemble` resolves a policy against the installed plugins,
checks what it can before any model work, loads (and, on several ranks, shards) the
model and returns a :class:`specdec.Pipeline`."""

from __future__ import annotations

import os
from typing import Any

import attrs

from .composition import check_batch, check_needs
from .errors import ModelLoadError, PolicyError, UnknownComponentError
from .pipeline import Pipeline
from .plugins import PluginHost, get_plugin_host
from .policy import AUTO, Policy
from .presets import DEFAULT_POLICY, load_policy

__all__ = ["assemble"]


def assemble(
    model_or_path: Any = None,
    tokenizer: Any = None,
    policy: Policy | str | os.PathLike | dict | None = DEFAULT_POLICY,
    *,
    draft_model: Any = None,
    host: PluginHost | None = None,
    distributed: bool | None = None,
    sharding: str = "auto",
) -> Pipeline:
    """Build a :class:`Pipeline` from a model (or path / Hub id) and a policy.

    Args:
        model_or_path: an mlx-lm model, a model folder, a Hub id, or ``None`` for
            the built-in default model.
        tokenizer: the tokenizer when ``model_or_path`` is a model object (optional:
            without one, prompts must be token ids).
        policy: a :class:`Policy`, preset name, TOML path or dict; by default
            ``"default"`` (:func:`specdec.default_policy`: the ``copy`` preset when
            specdec-plugin-ngram and specdec-plugin-copy-governor are installed, else
            ``none``). ``"none"`` (or ``None``) is plain decoding.
        draft_model: shorthand: adds the ``draft_model`` drafter with this model (path or
            object) to ``policy``; with ``policy`` left at ``"default"`` it drafts alone.
        host: a plugin host (default: the process-wide one).
        distributed: shard the model across the ranks of a distributed job (this process
            started by ``mlx.launch`` or ``mpirun`` as one of several ranks; see
            :mod:`specdec.distributed`). ``None`` (default): a model loaded from a path is
            sharded when the process is one of several ranks, and a model object is used
            as it is (already sharded, e.g. by mlx-lm's ``sharded_load``: its ranks are
            kept in step; else a whole model on every rank, decoding independently).
            ``True``: shard a model object too, in place, and fail when this process is
            not one of several ranks. ``False``: never shard.
        sharding: how to shard (see :func:`specdec.distributed.shard_model`):
            ``"auto"`` (tensor parallel where the model allows it, else pipeline
            parallel, as mlx-lm's ``sharded_load``), ``"tensor"`` or ``"pipeline"``.

    Raises:
        PolicyError / UnknownComponentError: bad policy or component names (before loading the model).
        ModelLoadError: the model cannot be loaded, or cannot be split across the ranks.
        DistributedError: ``distributed=True`` in a process that is not one of several ranks.
    """
    h = host or get_plugin_host()
    pol = load_policy(policy, host=h, draft_model=draft_model is not None)
    if draft_model is not None:
        if "draft_model" not in pol.drafters:
            pol = attrs.evolve(pol, drafters=(*pol.drafters, "draft_model"))
        pol = pol.with_options("draft_model", model=draft_model)
    _check_components(h, pol)
    from . import distributed as dist  # only when a pipeline is built: sharding may apply

    world = _world(dist, distributed, sharding)
    model, tokenizer = _model(model_or_path, tokenizer, dist, world, distributed, sharding)
    return Pipeline(model, tokenizer, pol, host=h)


def _check_components(h: PluginHost, pol: Policy) -> None:
    """Checks that need no model: every named component is installed, drafters' needs
    and named draft heads, batch support."""
    for n in pol.drafters:
        # Checks that need no model: declared capabilities and a named draft head.
        check_needs(h, pol, n)
        head = pol.options_for(n).get("head")
        if isinstance(head, str):
            try:
                h.get("draft_head", head)
            except UnknownComponentError as exc:
                raise PolicyError(f"drafter {n!r}: option head: {exc}") from exc
    if pol.governor:
        h.get("governor", pol.governor)
    h.get("verifier", pol.verifier)
    if pol.max_batch > 1:
        check_batch(h, pol)
    if pol.acceptor != AUTO:
        h.get("acceptor", pol.acceptor)
    if pol.rollback != AUTO:
        h.get("cache_rollback", pol.rollback)


def _world(dist: Any, distributed: bool | None, sharding: str) -> Any:
    """The ranks' group this pipeline shards across (``None``: one process)."""
    if sharding not in dist.SHARDING_KINDS:
        raise PolicyError(
            f"sharding must be one of {', '.join(dist.SHARDING_KINDS)}, got {sharding!r}"
        )
    world = None if distributed is False else dist.launched_world()
    if sharding != "auto" and world is None:
        raise dist.DistributedError(
            f"sharding={sharding!r} splits a model across the ranks of a distributed job, "
            "but this process is not one of several ranks (or distributed=False): start it "
            "with mlx.launch, or leave sharding='auto'"
        )
    if distributed and world is None:
        raise dist.DistributedError(
            "distributed=True, but this process is not one of several ranks: start it with "
            "mlx.launch (e.g. mlx.launch --backend ring -n 2 --hosts 127.0.0.1 script.py) "
            "or mpirun"
        )
    return world


def _model(
    model_or_path: Any, tokenizer: Any, dist: Any, world: Any, distributed: Any, sharding: str
) -> tuple[Any, Any]:
    """The model (loaded from a path or the default model, sharded when it must be) and
    its tokenizer."""
    if model_or_path is None or isinstance(model_or_path, (str, os.PathLike)):
        from .loading import check_model_path, load_model

        if model_or_path is None:
            try:
                from .models.default import default_model_path
            except (
                ImportError
            ) as exc:  # pragma: no cover - the default model module ships with the core
                raise ModelLoadError(f"no default model available: {exc}") from exc
            model_or_path = default_model_path()
        check_model_path(model_or_path)
        # Sharded: loaded lazily, so each rank materialises only its shard's weights.
        model, tok = load_model(model_or_path, lazy=world is not None)
        tokenizer = tokenizer or tok
        if world is not None:
            dist.shard_model(model, world, sharding)
    else:
        model = model_or_path
        # A model sharded elsewhere is adopted by Pipeline itself.
        if distributed and dist.model_sharding(model) is None and not dist.looks_sharded(model):
            dist.shard_model(model, world, sharding)
    return model, tokenizer
