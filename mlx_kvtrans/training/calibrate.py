"""Calibrating the fidelity gate: the threshold a translator's gap stays under on held-out text.

Calibration runs whole switches: a `Session` reads a held-out window with the source and hands
over to the target, and the gate's gap (`gate.compare`) is recorded. So it lives above the
session, and above both fitting stages: `fit` and `distill` return translators without a gate,
and `workflows` (the commands' library calls) or a caller adds one with `calibrate`.

Per band of prefix lengths and per kind of tail (text the source read, its own reply), the
threshold is a high quantile of the gaps over `windows` held-out windows plus a margin; the
record is what a manifest keeps under "gate" and what `gate.threshold` reads. Per band, too,
the copy probe's figures (`copy_gaps`): how much worse the translations copy the history than
the target's own cache, how much the target's own history lowers its NLL of the repeats (its
worth), and, where that is worth judging one switch by, the native gap's high quantile plus a
margin (`gate.copy_band`).
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import KvtransError
from ..translators.gate import COPY_MARGIN, COPY_WORTH, GATE_TOKENS, KINDS
from .relay_choice import choose as choose_relay

# needles drawn for calibration: apart from the held-out ones (evaluation.needles.HELD_OUT_SEED
# and above, which the frontier's draws are) and from distillation's (NEEDLE_SEED)
NEEDLE_SEED = 800_000_000
QUANTILE = 0.99
MARGIN = 0.5  # nats/token above the quantile: the held-out windows are few
# share of the windows whose tail the source read that are needles, question last: the tails
# users send are questions as well as prose, and a gate calibrated on prose alone re-read 4 of
# 48 held-out needle switches of qwen3.5-a -> qwen3.5-xt that needed no re-read
NEEDLE_SHARE = 0.5
WINDOWS = 64  # held-out windows of each kind and band a calibration reads
# prefix lengths calibrated apart: the gap of good translations grows where the models read past
# their training length (256 tokens in the zoo); a longer switch takes the last band's threshold
BANDS = ((32, 256), (257, 512))


def as_loaded(name: str, model):
    """`model` as the LoadedModel a Session holds (a bare mlx-lm model gets a stand-in)."""
    from ..models import LoadedModel

    return model if isinstance(model, LoadedModel) else LoadedModel(name, None, model, None, {})


def window_switch(translator, source, target, tokens: list[int], prefix: int, kind: str,
                  tail: int = GATE_TOKENS):
    """One held-out window through a `Session`, as a conversation meets the gate: the source
    reads `prefix` tokens (kind "read": the tail is text it read, and the next token is known)
    or reads them and writes `tail` + 1 more greedily (kind "generated"); then the switch.
    Returns the session: its switch (the gap in `gate_gap`) is `session.switches[-1]`."""
    from ..session import Session

    session = Session({"source": as_loaded("source", source),
                       "target": as_loaded("target", target)},
                      {("source", "target"): translator}, active="source", gate_tokens=tail,
                      reread=0)  # the gate's own tail, whatever the dial's default
    session.add(tokens[:prefix], model="target")  # across tokenizers the source reads its own
    if kind == "read":
        list(session.generate(0))
        session.add(tokens[prefix:prefix + 1], model="target")
    else:
        list(session.generate(tail + 1))
    session.switch("target")
    return session


def copy_gaps(session) -> tuple[float, float, float]:
    """(the copy gap of a calibration window's switch, the same probe's gap with the target
    reading from its own cache of the window, and with the target reading the probe alone):
    NaN where the probe cannot run (a span too short to probe, models that tokenize
    differently, a cache that cannot be put back)."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..session.line import CacheLine
    from ..translators.gate import copy_nll, copy_probe, copy_spans, read_copy

    status = session.switches[-1]
    src, tgt = session.lines["source"], session.lines["target"]
    span = range(status.tokens_sink, status.tokens_sink + status.tokens_translated)
    view = session.view("target")
    reading = None if session.across("source", "target") else read_copy(src, tgt, view, span)
    if reading is None or isinstance(reading, str):
        return np.nan, np.nan, np.nan
    probe = copy_probe(view, copy_spans(span.start, span.stop))
    own = CacheLine("native", tgt.lm, cache=make_prompt_cache(tgt.lm.model), seen=tgt.seen)
    tgt.lm.model(mx.array(view[:tgt.seen])[None], cache=own.cache)
    native = copy_nll(own.peek(probe), probe).item()  # read as the switch's probe is
    alone = copy_nll(tgt.lm.model(mx.array(probe)[None])[0], probe).item()
    return reading.gap, native - reading.source_nll, alone - reading.source_nll


def gap_summary(gaps: list[float]) -> dict:
    """The spread of a band's gaps, as the manifest records it."""
    a = np.asarray(gaps)
    return {"windows": len(gaps), "mean": round(float(a.mean()), 4),
            "std": round(float(a.std()), 4),
            **{f"q{int(q * 100)}": round(float(np.quantile(a, q)), 4) for q in (0.5, 0.9, 0.99)},
            "max": round(float(a.max()), 4)}


@dataclass(frozen=True)
class CalibrationConfig:
    """How the gate is calibrated. `windows`: held-out windows of each kind and band; `tail`:
    the tokens the gate reads (r); `bands`: prefix lengths calibrated apart; per band and kind
    the threshold is the gaps' `quantile` + `margin`; `needle_share`: about this share of the
    "read" windows are needles instead of prose, in the target's chat template where it has
    one: their tail is the question, which reads unlike prose, and a gate calibrated on prose
    alone re-reads such switches that needed no re-read. `copy_margin`: over the native copy
    gap's `quantile`, one switch's copy threshold."""

    windows: int = WINDOWS
    tail: int = GATE_TOKENS
    bands: tuple = BANDS
    seed: int = 0
    quantile: float = QUANTILE
    margin: float = MARGIN
    needle_share: float = NEEDLE_SHARE
    copy_margin: float = COPY_MARGIN


def calibrate(translator, source, target, token_ids: list[int],
              config: CalibrationConfig = CalibrationConfig(), progress=None,
              group=None) -> dict:
    """The gate's calibration of `translator` (source -> target: mlx-lm models or LoadedModels)
    on held-out `token_ids` (the target's; LoadedModels that tokenize differently each read
    their own tokens of the windows' text): per band of prefix lengths, the gap over
    `config.windows` windows of each kind and per kind the threshold. The record a manifest
    keeps under "gate". `progress(done, total)` follows the windows (this process's). A text
    too short for a band cuts it short or leaves it out. With `group` (every process of an
    `mx.distributed` group calls it), process r reads windows r, r + size, ... and the gaps are
    shared: every process returns the record one process would. The target's tokenizer writes
    the needles: a bare mlx-lm `target` is calibrated on prose alone."""
    tail, bands = config.tail, config.bands
    needle_share, seed = config.needle_share, config.seed
    started = time.perf_counter()
    if getattr(target, "tokenizer", None) is None:
        needle_share = 0.0
    rank, size = (0, 1) if group is None else (group.rank(), group.size())
    # measured without a threshold, so that no window falls back before its gap is read
    bare = replace(translator, info={k: v for k, v in translator.info.items() if k != "gate"})
    rng = random.Random(seed)
    picks = random.Random(seed + 1)  # which windows are needles: the prose draws stay as they are
    longest = len(token_ids) - tail - 3  # a prefix, its tail and the next token fit
    shortest = max(min(lo for lo, _ in bands), 2 * tail + 1)
    if longest < shortest:
        raise KvtransError(f"held-out text has {len(token_ids)} tokens, too few to calibrate "
                           f"the gate on (at least {shortest + tail + 3})")
    bands = [(max(lo, 2 * tail + 1), min(hi, longest)) for lo, hi in bands if lo <= longest]
    digest = hashlib.sha256()
    record = {"tail": tail, "quantile": config.quantile, "margin": config.margin,
              "copy_margin": config.copy_margin, "bands": []}
    if needle_share:
        record["needle_share"] = needle_share
    count = config.windows * len(KINDS)
    total, done = len(range(rank, count, size)) * len(bands), 0
    for lo, hi in bands:
        draws = []
        for i in range(count):
            length = rng.randint(lo, hi)
            begin = rng.randrange(0, len(token_ids) - length - tail - 1)
            draws.append((KINDS[i % len(KINDS)], length, token_ids[begin:begin + length + tail + 2]))
            if needle_share and draws[-1][0] == "read" and picks.random() < needle_share:
                draws[-1] = ("read", *_needle(target, NEEDLE_SEED + 10_000 * lo + i, length))
            digest.update(np.asarray(draws[-1][2], dtype=np.int32).tobytes())
        # the tail's gap; the copy gap, translated, native and with no history
        measured = np.full((count, 4), np.nan)
        failure = None
        try:
            for i in range(rank, count, size):
                kind, length, window = draws[i]
                session = window_switch(bare, source, target, window, length, kind, tail)
                status = session.switches[-1]
                if status.gate_gap is not None:
                    measured[i] = (status.gate_gap, *copy_gaps(session))
                done += 1
                if progress:
                    progress(done, total)
        except Exception as e:  # the others wait for this process's gaps: tell them
            failure = e
        if group is not None:
            measured, failed = _shared(measured, failure is not None, group)
            if failed and failure is None:
                raise KvtransError("another process failed to calibrate the gate (its error is "
                                   "in its output)")
        if failure is not None:
            raise failure
        tails, copies = measured[:, 0], measured[:, 1:]
        gaps = {kind: [float(tails[i]) for i in range(count)
                       if draws[i][0] == kind and not np.isnan(tails[i])] for kind in KINDS}
        if not all(gaps.values()):
            raise KvtransError("no window could be compared: the gate needs a translator a "
                               "session can switch with")
        record["bands"].append(_band((lo, hi), gaps, copies, config))
    record.update(seed=seed, data_sha256=digest.hexdigest(),
                  seconds=round(time.perf_counter() - started, 2))
    if size > 1:
        record["processes"] = size
    return record


def _band(prefix: tuple[int, int], gaps: dict[str, list[float]], copies: np.ndarray,
          config: CalibrationConfig) -> dict:
    """A band's record: per kind of tail its gaps and threshold; where the copy probe read
    half the windows or more (`copies`: their translated, native and no-history copy gaps, NaN
    where not), its loss against the target's own cache, the history's worth to the target's
    copying, and one switch's threshold where that worth is `COPY_WORTH` or more."""
    band = {"prefix": list(prefix),
            "threshold": {k: round(float(np.quantile(g, config.quantile)) + config.margin, 4)
                          for k, g in gaps.items()},
            "gap": {k: gap_summary(g) for k, g in gaps.items()}}
    probed = copies[~np.isnan(copies).any(axis=1)]
    if len(probed) >= len(copies) / 2:  # a quantile of a few windows is not a threshold
        native = float(np.quantile(probed[:, 1], config.quantile))
        worth = float((probed[:, 2] - probed[:, 1]).mean())
        band["copy"] = {"loss": round(float((probed[:, 0] - probed[:, 1]).mean()), 4),
                        "worth": round(worth, 4),
                        "native": gap_summary(probed[:, 1]),
                        "translated": gap_summary(probed[:, 0])}
        if worth >= COPY_WORTH:
            band["copy"]["threshold"] = round(native + config.copy_margin, 4)
    return band


def _needle(target, seed: int, length: int) -> tuple[int, list[int]]:
    """(where the switch comes, the prompt's tokens and the answer's): a calibration needle of
    about `length` tokens in the target's tokens, as users send them: every other one in the
    target's chat template where it has one (a fact in a user turn among others, the question in
    the last), the rest as plain text (a completion request, a router's raw prompt); its filler
    is the corpus's validation prose. Every other one of each form switches one token before the
    prompt's end: a generation that starts there reads the prompt's last token as its first
    step (mlx-lm's `generate_step`), and the question's tail reads differently cut there."""
    from ..evaluation.chat_needles import ChatNeedles
    from ..evaluation.needles import held_out_filler, needle_prompt_tokens

    tokenizer = getattr(target, "tokenizer", None)
    # needles are drawn for every other window (the "read" ones): alternate among those
    if getattr(tokenizer, "chat_template", None) and seed // 2 % 2 == 0:
        prompt, answer = ChatNeedles(tokenizer, prose=held_out_filler())(seed, length)
    else:
        prompt, answer = needle_prompt_tokens(tokenizer.encode, seed, length, held_out_filler())
    return len(prompt) - seed // 4 % 2, prompt + answer


def _shared(measured: np.ndarray, failed: bool, group) -> tuple[np.ndarray, bool]:
    """Every process's gaps (NaN where not read) -> all of them, on every process, and
    whether any process failed."""
    from ..backend.processes import summed

    flat = measured.reshape(-1)
    read = ~np.isnan(flat)
    both = summed(np.concatenate([np.where(read, flat, 0.0), read, [failed]]), group)
    n = len(flat)
    shared = np.where(both[n:2 * n] > 0, both[:n], np.nan)
    return shared.reshape(measured.shape), bool(both[-1])


def calibrate_directory(directory: str | Path, text: str | Path | None = None,
                        config: CalibrationConfig = CalibrationConfig()) -> dict:
    """Calibrate the gate of a translator directory (or shipped name) on held-out text
    (default: the zoo corpus's validation split), under the relay measured on it first
    (`relay.choose`), and write both into its manifest, replacing what is there; its weights
    are not touched. Returns the calibration. Under
    `mlx.launch`, the windows are dealt among the processes and the first one writes."""
    from ..models import held_out_split, load
    from ..translators import artifact
    from ..backend.processes import launched_group

    manifest = artifact.read_manifest(directory)
    source, target = load(manifest["source"]["name"]), load(manifest["target"]["name"])
    translator = artifact.load(directory, source, target)
    path = Path(text) if text is not None else held_out_split("validation")
    if path is None:
        raise KvtransError("no held-out text to calibrate on: give one, or build the zoo corpus")
    ids = target.tokenizer.encode(path.read_text(errors="replace"))
    group = launched_group()
    translator.info["relay"] = choose_relay(translator, source.model, target.model, ids)
    record = calibrate(translator, source, target, ids, config, group=group)
    if group is None or group.rank() == 0:
        artifact.update_manifest(directory, gate=record, relay=translator.info["relay"])
    return record
