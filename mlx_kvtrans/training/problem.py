"""Stage 2's problem: one batch of windows, the source's capture and the target's native
continuation fixed, and the loss of a translator's parameters on it (`Problem.loss`: the KL of
the target reading the translated cache against reading its own, with the rehearsals beside
it, `rehearsal.py`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import mlx.core as mx

from ..capture import capture
from ..capture.instrument import recording_indexer_scores
from ..layouts import CapturePoint, ObjectKind, layout_of
from ..translators.cross_tokenizer import across_capture
from ..translators.fidelity import kl_per_token, tempered_kl
from ..translators.install import install
from ..translators.recipes.token_map import TokenMap
from ..translators.translator import Translator, after
from .attention_weights import recording_attention_probabilities
from .rehearsal import (attention_rehearsal, indexer_rehearsal, object_rehearsal,
                        output_rehearsal, recording_mixer_outputs)

# the objects the object rehearsal holds: one row per token, as stage 1 fits them
TOKEN_KINDS = (ObjectKind.TOKEN_KEY, ObjectKind.TOKEN_VALUE, ObjectKind.MLA_LATENT,
               ObjectKind.ROPE_KEY, ObjectKind.INDEXER_KEY)


@dataclass(frozen=True)
class ProblemConfig:
    """How a batch is read: which rehearsals' natives it records (`attention`, `outputs`,
    `objects`), whether the continuation is the target's own greedy one, and the prefix's last
    `reread` and first `sink` tokens the target reads itself, as a session does."""

    attention: bool = False
    outputs: bool = False
    objects: bool = False
    greedy: bool = False
    reread: int = 0
    sink: int = 0


class Problem:
    """One batch of windows: the source's capture and the target's native continuation (fixed),
    from which `loss(params)` measures a translator's parameters."""

    def __init__(self, translator: Translator, source, target, windows: mx.array, prefix: int,
                 config: ProblemConfig = ProblemConfig(), tokenizers: tuple | None = None):
        reread, sink = config.reread, config.sink
        self.translator = translator
        self.target = target
        self.attention = config.attention
        self.outputs = config.outputs
        self.layout = layout_of(target)
        self.prefix_ids = windows[:, :prefix]
        self.inputs = windows[:, prefix:]
        self.prefix = prefix
        translated = prefix - min(reread, prefix - 1)
        self.sink = min(sink, translated - 1)
        self.translated_ids = self.prefix_ids[:, self.sink:translated]
        self.tail = self.prefix_ids[:, translated:]
        self.source = capture(source, self.prefix_ids[:, :translated],
                              points=translator.source_points()) if tokenizers is None else \
            across_capture(translator, source, tokenizers, self.prefix_ids[:, :translated])
        self.sink_cache = None
        if self.sink:  # the target's own cache of the first tokens, which the translation follows
            self.source = after(self.source, self.sink)
            self.sink_cache = capture(target, self.prefix_ids[:, :self.sink],
                                      points=(CapturePoint.ENGINE,), layout=self.layout).engine
        native_cache = capture(target, self.prefix_ids, points=(CapturePoint.ENGINE,),
                               layout=self.layout).engine
        self.rehearsed, self.native_objects = self._native_objects(translated) if config.objects \
            else ([], [])
        if config.greedy:  # on a copy: the native logits below read the prefix's cache as it is
            self.inputs = self._greedy_continuation(copy.deepcopy(native_cache))
        with self._recording() as (scores, probs, mixed):
            self.native_logits = target(self.inputs, cache=native_cache)
        self.native_scores = [mx.stop_gradient(s) for s in scores]
        self.native_attention = [mx.stop_gradient(p) for p in probs]
        self.native_outputs = [mx.stop_gradient(o.astype(mx.float32)) for o in mixed]
        mx.eval(self.native_logits, self.native_scores, self.native_attention,
                self.native_outputs)

    def _native_objects(self, translated: int) -> tuple[list, list[mx.array]]:
        """(the (layer, name) of every per-token object a map builds at raw or normed,
        the target's own of each over the translated tokens): the object rehearsal's targets."""
        wanted = [r for r in self.translator.recipes if isinstance(r, TokenMap)
                  and r.point in (CapturePoint.RAW, CapturePoint.NORMED)
                  and self.layout.layers[r.layer].cache.object(r.name).kind in TOKEN_KINDS]
        if not wanted:
            return [], []
        own = capture(self.target, self.prefix_ids[:, :translated],
                      points={r.point for r in wanted}, layout=self.layout,
                      select={(r.layer, r.name, r.point) for r in wanted})
        return ([(r.layer, r.name) for r in wanted],
                [mx.stop_gradient(own.objects[r.layer][(r.name, r.point)][:, self.sink:]
                                  .astype(mx.float32)) for r in wanted])

    def _greedy_continuation(self, cache) -> mx.array:
        """The window's first continuation token, then what the target says after it reading
        its own `cache` of the prefix: what a user of the switched target would be shown."""
        tokens = [self.inputs[:, :1]]
        for _ in range(self.inputs.shape[1] - 1):
            tokens.append(mx.argmax(self.target(tokens[-1], cache=cache)[:, -1:], axis=-1))
        return mx.concatenate(tokens, axis=1)

    @contextlib.contextmanager
    def _recording(self):
        with contextlib.ExitStack() as stack:
            scores = stack.enter_context(recording_indexer_scores(self.target))
            probs = (stack.enter_context(recording_attention_probabilities(self.target))
                     if self.attention else [])
            mixed = (stack.enter_context(recording_mixer_outputs(self.target))
                     if self.outputs else [])
            yield scores, probs, mixed

    def loss(self, params: dict, indexer_weight: float = 1.0, attention_weight: float = 0.0,
             output_weight: float = 0.0, object_weight: float = 0.0, temperature: float = 1.0):
        """(total, (KL, indexer rehearsal, attention rehearsal, output rehearsal, object
        rehearsal)) of `params` (a tree or flat) on this batch. The total's KL is taken at
        `temperature` (`tempered_kl`); the KL returned is at 1."""
        objects, points = self.translator.translate(self.source, self.target, self.layout,
                                                    self.translated_ids, params=params,
                                                    all_rows=self.sink > 0)
        cache = install(self.layout, objects, points, offset=self.sink,
                        cache=copy.deepcopy(self.sink_cache) if self.sink else None)
        n = self.inputs.shape[1]  # the re-read tail's positions are not scored
        with self._recording() as (scores, probs, mixed):
            logits = self.target(mx.concatenate([self.tail, self.inputs], axis=1),
                                 cache=cache)[:, -n:]
        scores = [s[:, -n:] for s in scores]
        probs = [p[..., -n:, :] for p in probs]
        kl = kl_per_token(self.native_logits, logits).mean()
        tempered = kl if temperature == 1.0 else tempered_kl(self.native_logits, logits,
                                                             temperature).mean()
        rehearsal = indexer_rehearsal(self.native_scores, scores, self.prefix)
        attention = attention_rehearsal(self.native_attention, probs)
        outputs = output_rehearsal(self.native_outputs, [o[:, -n:] for o in mixed])
        built = object_rehearsal(self.native_objects,
                                 [objects[layer][name] for layer, name in self.rehearsed])
        total = (tempered + indexer_weight * rehearsal + attention_weight * attention
                 + output_weight * outputs + object_weight * built)
        return total, (kl, rehearsal, attention, outputs, built)
