"""Recipes: one class per way of building a target cache object, each owning all of itself.

    token_map.py   map      per-token objects and conv-history rows: y = W [x | emb(id)] + b
    state.py       zero     an empty recurrent state
                   copy     the source's state or conv history, same geometry
                   bilinear copy with S_h -> A_h S_h B_h per value head
    replay.py      replay   predicted recurrence inputs, replayed through the target's recurrence

`base.Recipe` is the interface; a new recipe is one new class registered below.
"""

from __future__ import annotations

from .base import BuildInputs, FitBatch, PlanContext, Recipe, RecipeError, Widths
from .replay import Replay
from .state import Bilinear, Copy, Zero
from .token_map import TokenMap, assign_best_single, per_token_rows

RECIPES: dict[str, type[Recipe]] = {cls.recipe: cls for cls in (TokenMap, Zero, Copy, Bilinear,
                                                                Replay)}
# asked in this order when the user names no recipe for an object: the first that applies
DEFAULT_ORDER = (TokenMap, Copy, Replay)


def recipe_named(name: str) -> type[Recipe]:
    if name not in RECIPES:
        raise RecipeError(f"unknown recipe {name!r}; recipes: {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_from_json(data: dict) -> Recipe:
    return recipe_named(data["recipe"]).from_json(data)


__all__ = ["Bilinear", "BuildInputs", "Copy", "DEFAULT_ORDER", "FitBatch", "PlanContext",
           "RECIPES", "Recipe", "RecipeError", "Replay", "TokenMap", "Widths", "Zero",
           "assign_best_single", "per_token_rows", "recipe_from_json", "recipe_named"]
