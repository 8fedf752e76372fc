"""Stage 1: fit a planned translator in closed form.

One pass over the fitting data: each batch is prefilled through source and target with their
objects captured, and every recipe streams what it needs (second moments for maps, state pairs
for bilinear corrections); then each recipe solves for its parameters.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable

import mlx.core as mx
import numpy as np

from ..capture import capture
from ..capture.instrument import fastest_recurrence
from ..layouts import CapturePoint, ObjectKind, layout_of
from ..models import input_embedding
from .attention_weights import recording_attention
from ..translators.cross_tokenizer import AlignedText, batch_ids, realigned
from ..translators.features import layer_features, projection_name
from .fit_checkpoint import FitCheckpoint, held_interrupt
from .plan import designed, plan
from ..translators.recipes import FitBatch, Recipe, RecipeError, Replay, TokenMap
from ..backend.processes import mine, summed
from .distributed import check_batches, combine
from ..translators.random_features import RandomFeatures
from ..translators.stats import Covariance, SharedMoments
from ..translators.token_identity import TokenIdentity
from ..translators.translator import Translator


@dataclass(frozen=True)
class FitConfig:
    """Everything stage 1 is told: the plan's options and the fit's. `kvtrans fit` takes its
    defaults from here."""

    point: int = CapturePoint.RAW  # capture point of the source features and target objects
    nu: int = 2  # source layers per target layer
    features: str = "auto"  # what the maps read: auto, attention, nearest, all or same (plan.py)
    width: int = 0  # features "all": linear-attention rows compressed to this many directions
    recipes: dict = field(default_factory=dict)  # object kind or name -> recipe name
    points: dict = field(default_factory=dict)  # object kind or name -> capture point
    split_kv: bool = False
    headwise: bool = False
    token_identity: str = "off"  # off, ids, codebook
    ridge: float = 1e-3  # relative to the data scale
    attention_weighted: int = 0  # c > 0: weight prefix tokens by the last c tokens' attention
    identity_tables: int = 0  # r > 0: every token map gets rank-r identity tables (t, t-1)
    residual: int = 0  # h > 0: every token map gets a residual nonlinearity (stage 2 trains it)
    random_features: int = 0  # H > 0: every map's input gains H random features (random_features)
    random_layers: tuple[int, ...] = ()  # only these target layers' maps read them (): all
    replay_convolve: bool = False  # replay predicts k, v before the target's short convolution
    share_moments: bool = True  # maps reading the same features share one moment matrix
    windows: int = 256  # fitting windows (the command line's data)
    length: int = 256  # tokens per window
    mix: tuple[int, ...] = ()  # windows of these lengths instead, windows x length tokens in all
    pooling: str = "mean"  # across tokenizers: how a group's source tokens feed its target tokens
    assign: str = "relative"  # each target layer's source layers: by depth, or the best fit
    needle_share: float = 0.0  # share of the fitting windows that are synthetic needles

    def plan(self, source_layout, target_layout) -> list[Recipe]:
        recipes = plan(source_layout, target_layout, self.point, self.nu, self.recipes,
                       self.points, self.split_kv, self.headwise, self.features)
        if self.identity_tables:
            if self.token_identity == "off":
                raise RecipeError("identity tables need token identity: ids or codebook")
            recipes = [replace(r, tables=self.identity_tables) if isinstance(r, TokenMap) else r
                       for r in recipes]
        if self.replay_convolve:
            if self.point != CapturePoint.RAW:
                raise RecipeError("replay through the target's convolution reads features at "
                                  "raw (capture point 1): the rows before it")
            if not any(isinstance(r, Replay) for r in recipes):
                raise RecipeError("replay through the target's convolution: the plan replays "
                                  "no recurrent state (the target has none, or its states are "
                                  "copied or mapped: ask for recurrent_state=replay)")
            recipes = [replace(r, convolve=True) if isinstance(r, Replay) else r
                       for r in recipes]
        if self.residual:
            recipes = [replace(r, residual=self.residual) if isinstance(r, TokenMap) else r
                       for r in recipes]
        if self.random_features and self.random_layers:  # width where the loss is (layers.md)
            missing = set(self.random_layers) - {layer.index for layer in target_layout.layers}
            if missing:
                raise RecipeError(f"random_layers {sorted(missing)}: the target has "
                                  f"{len(target_layout.layers)} layers")
            recipes = [replace(r, expand=r.layer in self.random_layers)
                       if hasattr(r, "expand") else r for r in recipes]
        return recipes

    def to_json(self) -> dict:
        return {**asdict(self), "point": int(self.point)}


def compressed_layers(source_layout, recipes: list[Recipe], config: FitConfig) -> list[int]:
    """Source layers whose features are compressed: linear-attention layers a map reads, under
    features "all" with a width."""
    if not config.width:
        return []
    read = {s for r in recipes for s, _ in r.feature_reads()}
    return sorted(s for s in read if any(
        o.kind in (ObjectKind.CONV_HISTORY, ObjectKind.RECURRENT_STATE)
        for o in source_layout.layers[s].objects))


def fit(source_model, target_model, batches: Iterable[mx.array],
        recipes: list[Recipe] | None = None, config: FitConfig = FitConfig(),
        codebook: mx.array | None = None, progress=None,
        checkpoint: FitCheckpoint | None = None, group=None) -> Translator:
    """Fit `recipes` (default: `config`'s plan) on token `batches` ((B, T) id arrays, or
    `AlignedText`s for models that tokenize differently).

    `codebook`: the source's codebook, for `token_identity="codebook"`. The translator has no
    fidelity-gate calibration (`calibrate.calibrate` adds one; `workflows.fit_translator` does
    what `kvtrans fit` does, calibration included). With `config.attention_weighted` = c > 0
    the last c tokens of each window act as a continuation whose attention (in the target)
    weights the prefix tokens' errors; maps of attention layers are then fitted on the prefix
    only. Compressed features take a first pass over the batches for their principal
    directions. Peak memory, moment bytes and tokens/s go in `info["fit"]`. With `checkpoint`
    the running sums are written between batches and a resumed fit continues after the last
    batch written (`fit_checkpoint`); Ctrl-C then stops after the batch in flight. With a
    `group` of processes (`mx.distributed`, under `mlx.launch`) each process sums every
    size-th batch and the sums are combined before the solve (`shared_sums`): every process
    returns the translator a one-process fit makes.
    """
    started = time.perf_counter()
    mx.clear_cache()
    mx.reset_peak_memory()
    source_layout, target_layout = layout_of(source_model), layout_of(target_model)
    recipes = recipes if recipes is not None else config.plan(source_layout, target_layout)
    identity = TokenIdentity(config.token_identity, codebook)
    shell = _shell(source_layout, target_layout, recipes, config, identity)
    compress = compressed_layers(source_layout, recipes, config)
    group = group if group is not None and group.size() > 1 else None
    resumed = None
    if checkpoint is not None or group is not None:
        batches = list(batches)
        check_batches(len(batches), group)
    if checkpoint is not None:
        resumed = checkpoint.bind(config.to_json(), [r.to_json() for r in recipes], batches)
    if resumed is not None:
        shell.params.update({k: mx.array(v) for k, v in resumed["params"].items()})
        started -= resumed["seconds"]  # the fit's time is both runs
    elif compress:
        batches = list(batches)
        shell.params.update(principal_directions(source_model, source_layout, batches, shell,
                                                 compress, config.width, group))
    fresh = {"shared": SharedMoments() if config.share_moments else None}
    stats: dict = fresh if resumed is None else resumed["stats"]
    data_hash, across = hashlib.sha256(), False
    done, tokens_seen, decoded_right = (0, 0, 0) if resumed is None else (
        resumed["batches"], resumed["tokens"], resumed["decoded_right"])
    sums = _Sums(source_model, target_model, source_layout, target_layout, shell, recipes,
                 config, identity, input_embedding(target_model), stats["shared"], stats)

    def keep(summed: int, tokens: int, right: int) -> None:
        checkpoint.save({"batches": summed, "tokens": tokens, "decoded_right": right,
                         "seconds": time.perf_counter() - started, "stats": stats,
                         "params": {k: np.array(v) for k, v in shell.params.items()}})
    with held_interrupt() if checkpoint is not None else contextlib.nullcontext(
            lambda: False) as interrupted:
        for i, tokens in enumerate(batches):
            aligned = isinstance(tokens, AlignedText)
            across |= aligned
            for ids in batch_ids(tokens):
                data_hash.update(np.asarray(ids, dtype=np.int32).tobytes())
            if i < done or not mine(i, group):
                continue
            seen, right = _fit_batch(sums, tokens if aligned else mx.array(tokens))
            tokens_seen += seen
            decoded_right += right
            if progress:
                progress(i + 1, tokens_seen)
            if checkpoint is not None and (interrupted() or checkpoint.due()):
                keep(i + 1, tokens_seen, decoded_right)
            if interrupted():
                raise KeyboardInterrupt
    if checkpoint is not None and done < len(batches):  # every batch summed: kept until saved
        keep(len(batches), tokens_seen, decoded_right)
    if group is not None:
        combine(stats, group)
        tokens_seen, decoded_right = (int(n) for n in summed(
            np.array([tokens_seen, decoded_right]), group))
    return _solved(sums, started, tokens_seen, decoded_right, data_hash, across)


def _shell(source_layout, target_layout, recipes: list[Recipe], config: FitConfig,
           identity: TokenIdentity) -> Translator:
    """The translator a fit fills: its recipes, no parameters yet."""
    mode = designed(source_layout, target_layout, config.features)
    expansion = RandomFeatures(config.random_features) if config.random_features else None
    return Translator(CapturePoint(config.point), identity, recipes, {},
                      {"features": {"mode": mode, "width": config.width}}, expansion=expansion)


@dataclass
class _Sums:
    """What every batch of one fit streams into: the two models, the translator being built,
    its recipes and their running sums (`stats`)."""

    source_model: object
    target_model: object
    source_layout: object
    target_layout: object
    shell: Translator
    recipes: list
    config: FitConfig
    identity: TokenIdentity
    embed: object
    shared: SharedMoments | None
    stats: dict

    @property
    def target_points(self) -> set:
        """The target's capture points the recipes read, and its cache (ENGINE)."""
        return set().union(*(r.target_points() for r in self.recipes)) | {CapturePoint.ENGINE}


def _fit_batch(sums: _Sums, tokens) -> tuple[int, int]:
    """Capture one batch through both models and stream it into every recipe's sums (an
    `AlignedText`: each model reads its own tokens, the source's pooled onto the target's).
    Returns (tokens read, tokens whose identity the source's cache decoded right)."""
    source_model, target_model = sums.source_model, sums.target_model
    source_layout, target_layout = sums.source_layout, sums.target_layout
    shell, config = sums.shell, sums.config
    shared = sums.shared
    aligned = tokens if isinstance(tokens, AlignedText) else None
    # the fastest recurrence also holds the least: the token loop keeps every step's state
    with fastest_recurrence():
        src = capture(source_model, tokens if aligned is None else aligned.source,
                      points=shell.source_points(), layout=source_layout)
    if aligned is not None:
        tokens = aligned.target
        src = realigned(src, aligned)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fastest_recurrence())
        attention = (stack.enter_context(recording_attention(target_model, target_layout,
                                                              config.attention_weighted))
                     if config.attention_weighted else {})
        tgt = capture(target_model, tokens, points=sums.target_points, layout=target_layout)
    ids = sums.identity.ids(src, tokens)
    right = 0 if ids is None else int((ids == tokens).sum())
    embed = sums.embed
    batch = FitBatch(src, tgt, shell.features(src),
                     None if ids is None else embed(ids).astype(mx.float32), attention,
                     shared, ids, embed.weight.shape[0], shell.expansion)
    for recipe in sums.recipes:
        recipe.accumulate(batch, sums.stats)
    if shared is not None:
        shared.flush()
    return tokens.size, right


def _solved(sums: _Sums, started: float, tokens_seen: int, decoded_right: int, data_hash,
            across: bool = False) -> Translator:
    """Solve every recipe from its sums; the fit's record in `info`."""
    shell, config = sums.shell, sums.config
    recipes, stats = sums.recipes, sums.stats
    params, metrics = dict(shell.params), {}
    fitted = [recipe.fitted(stats) for recipe in recipes]
    for recipe in fitted:
        own, scores = recipe.solve(stats, config.ridge)
        params.update({f"{recipe.key}.{name}": value for name, value in own.items()})
        metrics.update({recipe.key + (f".{name}" if name else ""): value
                        for name, value in scores.items()})
    seconds = time.perf_counter() - started
    shell.recipes, shell.params = fitted, params
    shell.info["fit"] = {"stage": 1, "tokens": tokens_seen, "ridge": config.ridge,
                         "length": config.length, "mix": list(config.mix),
                         "attention_weighted": config.attention_weighted,
                         "data_sha256": data_hash.hexdigest(), "seconds": round(seconds, 2),
                         "tokens_per_second": round(tokens_seen / max(seconds, 1e-9), 1),
                         "peak_memory_bytes": mx.get_peak_memory(),
                         "moments_bytes": moments_bytes(stats)}
    shell.info["metrics"] = metrics
    if across:  # how a translation pools the source's tokens onto the target's
        shell.info["alignment"] = {"pooling": config.pooling}
    if config.token_identity == "codebook":
        shell.info["fit"]["codebook_decode_accuracy"] = round(decoded_right / tokens_seen, 5)
    return shell


def principal_directions(source_model, source_layout, batches, shell: Translator,
                         layers: list[int], width: int, group=None) -> dict[str, mx.array]:
    """A first pass: each compressed source layer's top-`width` principal directions."""
    covariances: dict[int, Covariance] = {}
    for i, tokens in enumerate(batches):
        if not mine(i, group):
            continue
        with fastest_recurrence():
            src = capture(source_model, tokens.source if isinstance(tokens, AlignedText)
                          else mx.array(tokens), points={shell.source_point},
                          layout=source_layout)
        for layer in layers:
            x = layer_features(src, layer, shell.source_point)
            covariances.setdefault(layer, Covariance(x.shape[-1])).add(x)
    if group is not None:
        combine(covariances, group)
    return {projection_name(layer): mx.array(c.principal_directions(width))
            for layer, c in covariances.items()}


def moments_bytes(stats: dict) -> int:
    """Host bytes of every second-moment matrix the fit held."""
    total = stats["shared"].nbytes if stats.get("shared") is not None else 0
    for entry in stats.values():
        if isinstance(entry, dict) and "moments" in entry:
            total += sum(m.xx.nbytes + m.xy.nbytes for m in entry["moments"].values())
            total += entry["tables"].nbytes if "tables" in entry else 0
    return total


FIT_BATCH = 4  # fitting windows per prefill, as `kvtrans fit` reads them


def token_windows(token_ids: list[int], length: int, count: int, batch: int, seed: int = 0,
                  needles: list[list[int]] | None = None, needle_share: float = 0.0):
    """`count` windows of `length` tokens, evenly spread over `token_ids`, in batches; with
    `needles` (`needle_rows`), that share of the windows are needles cut so that their
    question and answer end the window (where `attention_weighted` takes its queries)."""
    stride = max(1, (len(token_ids) - length) // max(1, count))
    starts = [i * stride for i in range(count) if i * stride + length <= len(token_ids)]
    if not starts:
        raise ValueError(f"the fitting text has {len(token_ids)} tokens: fewer than one window "
                         f"of {length}")
    rows = [token_ids[s:s + length] for s in starts]
    if needles and needle_share:
        every = max(1, round(1 / needle_share))  # evenly interleaved: each batch gets its share
        rows = [needles[(i // every) % len(needles)][-length:] if i % every == 0 else row
                for i, row in enumerate(rows)]
    for i in range(0, len(rows), batch):
        yield mx.array(rows[i:i + batch])


def mixed_windows(token_ids: list[int], lengths: tuple[int, ...], tokens: int,
                  batch_tokens: int, needles_for=None, needle_share: float = 0.0) -> list:
    """Batches of windows of every length in `lengths` (one length per batch, about
    `batch_tokens` tokens each), `tokens` in all split evenly among the lengths, interleaved so
    that the streamed moments see every length throughout; `needles_for(length)`: needle rows
    of that length, for `needle_share`."""
    parts = []
    for length in lengths:
        needles = needles_for(length) if needles_for and needle_share else None
        parts.append(list(token_windows(token_ids, length,
                                        max(1, tokens // len(lengths) // length),
                                        batch=max(1, batch_tokens // length), needles=needles,
                                        needle_share=needle_share)))
    return [batch for group in itertools.zip_longest(*parts) for batch in group
            if batch is not None]
