"""The relay: a few of the target's own layers read a switch's span again, fed the source's
residual stream where the two models' residuals align (DroidSpeak, arXiv 2411.02820: reuse the
cache of most layers and recompute the few where reuse loses most, starting from the sender's
hidden state at the first recomputed layer).

Between models that share a hidden width and most of their stack (a depth-pruned or healed
sibling), a translation can keep how the history reads on and still lose which tokens it held:
the copy probe sees it (`gate.copy_nll`), and it sits in a few layers. The target rerunning those
layers over the span, from the source's hidden state entering the aligned source layer, gets it
back for a few layers of a prefill: the layers below keep their translation, and no layer above
is touched. Calibration measures whether a pair needs a relay and which one
(`training.relay_choice`); the translator's manifest keeps it under "relay", and every switch
runs it (`install.translate_into`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from ..capture.instrument import language_model


@dataclass(frozen=True)
class Relay:
    """The target's layers `first`..`last` read the span from the source's hidden state
    entering its layer `source_layer`."""
    first: int
    last: int
    source_layer: int

    @property
    def layers(self) -> range:
        return range(self.first, self.last + 1)


def relay_of(translator) -> Relay | None:
    """The relay a translator's manifest records, None where it has none."""
    chosen = (getattr(translator, "info", {}).get("relay") or {}).get("chosen")
    return None if chosen is None else Relay(*chosen)


def describe(record: dict | None) -> str:
    """One line of what a manifest's "relay" record says."""
    if not record:
        return "relay: not measured"
    chosen = record.get("chosen")
    if chosen is None:
        return f"relay: none ({record.get('why', '')})"
    first, last, j = chosen
    return (f"relay: target layers {first}-{last} read the span from source layer {j} "
            f"(copy loss {record['translated']:+.2f} -> {record['copy_loss']:+.2f})")


def run(model, cache: list, residual: mx.array, relay: Relay) -> None:
    """The relay's layers of `model` over the span whose source hidden state is `residual`
    (B, T, hidden), in place of what `cache` holds for those T tokens: each of its layers'
    caches goes back T tokens and reads them again."""
    stack = language_model(model).model.layers
    n = residual.shape[1]
    for i in relay.layers:
        cache[i].trim(n)
    h = residual
    mask = create_attention_mask(h, cache[relay.first])
    for i in relay.layers:
        h = stack[i](h, mask, cache[i])
    mx.eval([cache[i].state for i in relay.layers])
