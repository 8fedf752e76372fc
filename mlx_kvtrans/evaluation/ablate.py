"""Ablation: what each cache object carries, and what translating it alone costs.

For each layer and cache object of a model: the model continues held-out text (and answers
held-out needles) from its own cache with that one object zeroed, and, given a translator into
the model, from its own cache with only that object translated. Each case reports the KL against
the native continuation (nats/token), greedy agreement, the history's worth recovered, exact
needle recall and the copy loss (the fidelity gate's copy probe: the model's NLL reading spans of
the prompt again from the case's cache, minus from its own; where a translation blurs the
history's tokens); the no-cache floor sits beside them. Recovered is the frontier's measure, taken
as it takes it: teacher-forced agreement with the native target's `GENERATED` greedy tokens,
above what the last `FLOOR_TOKENS` prompt tokens alone give. This is the hybrid-translation
paper's swap-in analysis for any model or pair.

"Translated from layer k up" keeps the target's own first k layers: the ceiling of a switch
that rebuilds those layers itself (reading every token through them, k / N of a full re-read; the
first layers are the only ones a target can rebuild without reading through all of them).

Zeroing a recurrent state or a conv history is exactly "no history" for that object. Zeroing an
attention object keeps its positions in the softmax (zero keys score 0, zero values add nothing),
so it removes the content but not the positions.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import mlx.core as mx

from ..capture import capture
from ..translators.install import install
from ..layouts import CapturePoint, layout_of
from ..translators.fidelity import agreement, greedy, kl_per_token
from ..translators.gate import copy_nll, copy_probe, copy_spans
from ..translators.frontier import GENERATED, history_recovered
from .frontier import floor_agreement
from .needles import needle_scores


@dataclass(frozen=True)
class Case:
    name: str  # "native", "zero", "translated" or "no cache"
    layer: int | None = None
    object: str | None = None  # with a layer and no object: every object of that layer
    kind: str | None = None  # with no layer: every object of this kind
    above: int | None = None  # translated: every layer from this one up, the ones below native

    @property
    def label(self) -> str:
        if self.above is not None:
            return f"{self.name} from layer {self.above} up"
        if self.layer is None:
            return f"{self.name} every {self.kind}" if self.kind else \
                f"{self.name} all" if self.name in ("zero", "translated") else self.name
        if self.object is None:
            return f"{self.name} layer {self.layer}"
        return f"{self.name} {self.layer}.{self.object}"

    def covers(self, layer, name: str) -> bool:
        if self.above is not None:
            return layer.index >= self.above
        if self.layer is not None:
            return layer.index == self.layer and self.object in (None, name)
        return self.kind is None or layer.cache.object(name).kind.value == self.kind


def cases(layout, translated: bool) -> list[Case]:
    out = [Case("native"), Case("no cache"), Case("zero")]
    kinds = sorted({o.kind.value for layer in layout.layers for o in layer.objects})
    out += [Case("zero", kind=k) for k in kinds] if len(kinds) > 1 else []
    if translated:  # where translation loses what: all of it, each layer, each object
        out.append(Case("translated"))
        out += [Case("translated", layer.index) for layer in layout.layers
                if len(layer.objects) > 1]
        # the target's own first k layers under a translation of the rest: what a switch that
        # rebuilt its first layers (k / N of a prefill) would keep
        out += [Case("translated", above=k) for k in range(1, len(layout.layers))]
    for layer in layout.layers:
        for obj in layer.objects:
            out.append(Case("zero", layer.index, obj.name))
            if translated:
                out.append(Case("translated", layer.index, obj.name))
    return out


class Ablation:
    """Builds the cache of each case for a prompt (`translator`/`source`: a translator into
    `model` and its source model, for the "translated" cases)."""

    def __init__(self, model, translator=None, source=None):
        self.model = model
        self.translator = translator
        self.source = source
        self.layout = layout_of(model)

    def cache(self, case: Case, prompt: mx.array):
        if case.name == "no cache":
            return None
        tokens = prompt[None] if prompt.ndim == 1 else prompt
        if case.name == "translated":
            src = capture(self.source, tokens, points=self.translator.source_points())
            moved, points = self.translator.translate(src, self.model, self.layout, tokens)
            native = capture(self.model, tokens, points={p for d in points for p in d.values()},
                             layout=self.layout)
            objects = [{name: moved[i][name] if case.covers(layer, name)
                        else native.objects[i][(name, points[i][name])] for name in points[i]}
                       for i, layer in enumerate(self.layout.layers)]
            return install(self.layout, objects, points)
        native = capture(self.model, tokens, points={CapturePoint.ENGINE}, layout=self.layout)
        objects = [{name: value for (name, _), value in layer.items()} for layer in native.objects]
        if case.name == "zero":
            for layer, found in zip(self.layout.layers, objects):
                for name in found:
                    if case.covers(layer, name):
                        found[name] = mx.zeros_like(found[name])
        return install(self.layout, objects, CapturePoint.ENGINE)


@dataclass(frozen=True)
class AblateConfig:
    """What `ablate` measures and on how much, apart from the models and text."""
    lengths: list[int]  # prompt lengths
    windows: int = 4  # held-out windows per length
    needles: int = 20  # held-out needles per length
    continuation: int = 32  # tokens after each prompt the KL is taken over
    generated: int = 16  # greedy tokens compared for agreement
    seed: int = 0  # where the windows start
    only: set[str] | None = None  # the labels of the cases to run; None: all


def ablate(model, encode, token_ids: list[int], config: AblateConfig, translator=None,
           source=None, progress=None, make=None) -> list[dict]:
    """Per case: {"case", "layer", "object", "lengths": {L: {"kl", "agreement", "recovered",
    "recall", "copy"}}} (recovered None where the floor already agrees everywhere).
    `encode`: the model's tokenizer encode (for the needles); `token_ids`: held-out text;
    `make`: the needles' format (`needles.needle_report`)."""
    lengths, generated = config.lengths, config.generated
    ablation = Ablation(model, translator, source)
    todo = [c for c in cases(ablation.layout, translator is not None)
            if config.only is None or c.label in config.only]
    rows = [{"case": c.name, "label": c.label, "layer": c.layer, "object": c.object,
             "kind": c.kind, "above": c.above, "lengths": {}} for c in todo]
    total, done = len(todo) * len(lengths), 0
    for length in lengths:
        span = length + config.continuation
        if len(token_ids) < span + 1:
            raise ValueError(f"held-out text has {len(token_ids)} tokens, fewer than {span + 1}")
        rng = random.Random(config.seed + length)
        starts = [rng.randrange(0, len(token_ids) - span) for _ in range(config.windows)]
        prefixes = []
        natives = []
        fed = []
        floors = []
        probes = []  # per window: the copy probe's tokens and the native reading of them
        for start in starts:
            window = mx.array(token_ids[start:start + span])
            prefix, inputs = window[:length - 1], window[length - 1:span - 1][None]
            last = int(window[length - 1])
            native_cache = ablation.cache(Case("native"), prefix)  # once: each use reads a copy
            prefixes.append((prefix, inputs, last))
            said = greedy(model, last, copy.deepcopy(native_cache),
                          max(generated, GENERATED))  # the native greedy continuation
            natives.append((ablation.model(inputs, cache=copy.deepcopy(native_cache)), said))
            fed.append(mx.array([last] + said[:GENERATED - 1])[None])  # teacher forcing
            floors.append(floor_agreement(model, prefix.tolist() + [last], said[:GENERATED]))
            probe = copy_probe(prefix.tolist(), copy_spans(0, length - 1))  # none under a span
            native_copy = copy_reading(model, native_cache, probe) if probe else None
            probes.append((probe, native_copy))
        for case, row in zip(todo, rows):
            if progress:
                progress(done, total, f"{case.label} at {length:,} tokens")
            done += 1
            kls = []
            agrees = []
            forced = []
            copies = []
            for (prefix, inputs, last), (native_logits, said), tokens, (probe, native_copy) in zip(
                    prefixes, natives, fed, probes):
                built = ablation.cache(case, prefix)  # once: each use below grows a copy
                logits = model(inputs, cache=copy.deepcopy(built))
                kls.append(float(kl_per_token(native_logits, logits).mean()))
                agrees.append(agreement(said[:generated], greedy(
                    model, last, copy.deepcopy(built), generated)))
                predicted = mx.argmax(model(tokens, cache=copy.deepcopy(built))[0], -1)
                forced.append(agreement(said[:GENERATED], predicted.tolist()))
                if probe:
                    copies.append(copy_reading(model, copy.deepcopy(built), probe) - native_copy)
            recall, _ = needle_scores(
                model, encode, length, config.needles, make=make,
                cache_for=lambda ids, case=case: ablation.cache(case, mx.array(ids)))
            row["lengths"][str(length)] = {"kl": sum(kls) / len(kls),
                                           "agreement": sum(agrees) / len(agrees),
                                           "recovered": history_recovered(
                                               sum(forced) / len(forced),
                                               sum(floors) / len(floors)),
                                           "recall": recall,
                                           "copy": sum(copies) / len(copies) if copies else None}
    return rows


def copy_reading(model, cache, probe: list[int]) -> float:
    """The model's NLL of the copy probe's repeats (`gate.copy_nll`) read on top of `cache`."""
    return float(copy_nll(model(mx.array(probe)[None], cache=cache)[0], probe))
