"""A translator for timing: the shapes a fit would give, random weights.

Time depends on shapes only, and a closed-form fit on a real checkpoint's sizes would hold a
(features x features) moment matrix per map: this one is built from the layouts alone.
"""

from __future__ import annotations

import mlx.core as mx

from ..layouts import CapturePoint, layout_of
from ..training.cost import layout_widths
from ..translators.token_identity import TokenIdentity
from ..translators.translator import Translator


def shaped_translator(source_model, target_model, recipes, source_point=1) -> Translator:
    """A translator with the shapes `fit` would give `recipes`, and random weights: for timing
    models of real checkpoints' sizes, where time depends on shapes only and a closed-form fit
    would hold a (features x features) moment matrix per map (a KDA layer alone reads 12,288).
    Shapes come from the layouts alone: nothing is prefilled."""
    widths = layout_widths(layout_of(source_model), layout_of(target_model), recipes,
                           source_point)
    recipes = [r.shaped(widths) for r in recipes]
    key = mx.random.key(0)
    params = {}
    for recipe in recipes:
        for name, shape in recipe.param_shapes(widths).items():
            if name in ("A", "B"):  # a state correction starts at the identity
                value = mx.broadcast_to(mx.eye(shape[-1]), shape)
            elif len(shape) == 1:
                value = mx.zeros(shape)
            else:
                value = mx.random.normal(shape, key=key) * shape[-1] ** -0.5
            params[f"{recipe.key}.{name}"] = value
    mx.eval(params)
    return Translator(CapturePoint(source_point), TokenIdentity(), recipes, params)
