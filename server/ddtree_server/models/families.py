"""The model families, one row each: how a config is recognised, how a folder loads, how a module of
random weights is built, which CUDA-graph wrapper replays it, and whether train-drafter must run our
forward. Every place that needs to know a family asks this table (models/load.py, random_init.py,
engine/engine.py, train/own_target.py); adding a family is its folder + one row + tests
(docs/architecture.md, "How to add a model family").

Rows are tried in order; the last one takes every config:
* ``qwen3_5`` / ``qwen3_5_text`` (Qwen3.5 / Qwen3.6 hybrids: Gated DeltaNet + gated attention) run
  on our HybridTarget (models/hybrid/) and verify trees;
* other hybrid / recurrent architectures (incl. the MoE ``qwen3_5_moe``) are served by ``HFRunner``
  (plain decoding through transformers' model), tree mode unavailable;
* llama / mistral / qwen2 / qwen3 run on our TargetModel (models/dense/) and verify trees;
* any other model_type: ``HFRunner``, tree mode unavailable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ddtree_server.models.common import LoadedTarget
from ddtree_server.models.dense.graphs import GraphedTarget
from ddtree_server.models.dense.load import as_config, load_dense_folder
from ddtree_server.models.dense.target import TREE_FAMILIES, TargetModel
from ddtree_server.models.hf_runner import load_hf_folder
from ddtree_server.models.hybrid.config import HYBRID_TYPES, HybridConfig, hybrid_model_type
from ddtree_server.models.hybrid.graphs import GraphedHybrid
from ddtree_server.models.hybrid.load import load_hybrid_folder
from ddtree_server.models.hybrid.model import DEFAULT_METHOD, HybridTarget

_RECURRENT_TYPES = ("qwen3_5", "qwen3_next", "mamba", "jamba", "falcon_h1", "zamba", "bamba",
                    "nemotron_h", "granitemoehybrid", "lfm2", "recurrent_gemma", "rwkv", "xlstm", "minimax")
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention"}
_PLAIN = "tree mode unavailable, serving with plain autoregressive decoding (transformers model)"


@dataclass(frozen=True)
class Family:
    """One model family: what the loader, random init, engine and trainer need to know of it."""

    name: str
    matches: Callable[[Any], bool]       # config predicate: config.json dict or config object
    describe: Callable[[str], str]       # the start-up line for a model_type
    load: Callable[..., LoadedTarget]    # (folder, config, dtype, device, start-up line) -> LoadedTarget
    tree: bool                           # tree verification available (our forward)
    own_config: bool = False             # load() reads the config.json dict itself (no transformers class)
    model: type | None = None            # our module class (None: transformers' model)
    build: Callable[[Any, str | None], nn.Module] | None = None  # (config, GDN method) -> module (random init)
    graphed: Callable[[nn.Module], Any] | None = None            # CUDA-graph wrapper of ``model``
    train_own_forward: bool = False      # train-drafter runs our forward (transformers cannot run it as served)
    model_types: tuple[str, ...] = ()    # the model_type names it serves (messages)


def model_type(config) -> str:
    """``model_type`` of a config.json dict or a config object ("?" when absent)."""
    return str(config.get("model_type", "?") if isinstance(config, dict) else getattr(config, "model_type", "?"))


def _layer_types(config) -> set:
    found = config.get("layer_types") if isinstance(config, dict) else getattr(config, "layer_types", None)
    return set(found or [])


def _recurrent(config) -> bool:
    return model_type(config).startswith(_RECURRENT_TYPES) or bool(_layer_types(config) - _ATTENTION_LAYER_TYPES)


HYBRID = Family(
    name="hybrid", model_types=HYBRID_TYPES, tree=True, own_config=True, train_own_forward=True,
    matches=lambda c: hybrid_model_type(c) is not None or isinstance(c, HybridConfig),
    describe=lambda mt: f"target {mt}: hybrid Gated DeltaNet + gated attention (our HybridTarget), tree mode available",
    load=load_hybrid_folder, model=HybridTarget, graphed=GraphedHybrid,
    build=lambda config, method: HybridTarget(config, method or DEFAULT_METHOD))
RECURRENT = Family(
    name="recurrent", tree=False, matches=_recurrent, load=load_hf_folder,
    describe=lambda mt: f"target {mt} is a hybrid/recurrent architecture: {_PLAIN}")
DENSE = Family(
    name="dense", model_types=TREE_FAMILIES, tree=True,
    matches=lambda c: model_type(c) in TREE_FAMILIES,
    describe=lambda mt: f"target {mt}: tree mode available",
    load=load_dense_folder, model=TargetModel, graphed=GraphedTarget,
    build=lambda config, method: TargetModel(as_config(config)))
OTHER = Family(
    name="transformers", tree=False, matches=lambda c: True, load=load_hf_folder,
    describe=lambda mt: f"target {mt} is not one of {', '.join(TREE_FAMILIES)}: {_PLAIN}")

FAMILIES: tuple[Family, ...] = (HYBRID, RECURRENT, DENSE, OTHER)


def family_of(config) -> Family:
    """The first row whose predicate takes ``config`` (a config.json dict or a config object)."""
    return next(f for f in FAMILIES if f.matches(config))


def detect_family(config) -> tuple[bool, str]:
    """(tree_capable, start-up message) for a transformers config (or its config.json dict)."""
    family = family_of(config)
    return family.tree, family.describe(model_type(config))


def buildable_types() -> list[str]:
    """model_type names a module of random weights can be built for (``random_init``)."""
    return [t for f in FAMILIES if f.build is not None for t in f.model_types]


def graphed(model: nn.Module):
    """``model`` wrapped in its family's CUDA-graph replay, or None when no family of ours owns it
    (e.g. an HFRunner)."""
    for family in FAMILIES:
        if family.model is not None and family.graphed is not None and isinstance(model, family.model):
            return family.graphed(model)
    return None
