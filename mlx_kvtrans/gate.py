"""The fidelity gate: does the target continue from a translated cache as the source would?

At a switch the target receives the span it has not seen translated, except its last r tokens,
which it reads itself on top of the translation (C = N - r, as the hybrid-translation paper
times its handoff; the target must read them anyway). Its mean NLL on those tokens, beside the
source's NLL on the same tokens, is the gap:

    gap = mean_i NLL_T(x_i | translated cache, x_C..x_i-1) - mean_i NLL_S(x_i | x_<i)

The source's NLL comes from what it computed while reading or writing those tokens: a `Tail` of
its final-norm rows, kept as it goes, turned into NLLs only at a switch (r rows through the
output head, never the whole prompt). A translator's manifest carries the threshold the gap of
good translations stays under (`calibrate`: a high quantile over held-out windows plus a
margin), measured when it is fitted or distilled; a switch whose gap is over it re-reads.

A model's NLL on the tokens it sampled itself is lower than on text it read (greedy decoding
picks its most likely token), so the gap runs higher when the tail is the source's own reply;
calibration measures both kinds of tail and a switch takes the threshold of the mix it holds.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import KvtransError
from .instrument import output_head

GATE_TOKENS = 8  # r: the span's last tokens the target reads itself
QUANTILE = 0.99
MARGIN = 0.5  # nats/token above the quantile: the held-out windows are few
WINDOWS = 64  # held-out windows of each kind and band a calibration reads
# prefix lengths calibrated apart: the gap of good translations grows where the models read past
# their training length (256 tokens in the zoo); a longer switch takes the last band's threshold
BANDS = ((32, 256), (257, 512))
KINDS = ("read", "generated")


@dataclass(frozen=True)
class Tail:
    """Final-norm rows of the last tokens a model read: row i is its hidden state after reading
    conversation token `start + i`, from which it predicts token `start + i + 1`."""

    rows: mx.array  # (k, D), in the dtype the model computed them in
    start: int
    generated: tuple[bool, ...]  # per row: the model sampled the next token from it

    @property
    def end(self) -> int:
        return self.start + len(self.generated)

    def cut(self, stop: int) -> "Tail | None":
        """The rows of tokens before `stop`."""
        n = min(stop, self.end) - self.start
        return Tail(self.rows[:n], self.start, self.generated[:n]) if n > 0 else None

    def then(self, later: "Tail", keep: int) -> "Tail":
        """`later` after this one (joined when it starts where this ends), its last `keep` rows."""
        if later.start == self.end:
            later = Tail(mx.concatenate([self.rows, later.rows]), self.start,
                         self.generated + later.generated)
        drop = max(0, len(later.generated) - keep)
        return Tail(later.rows[drop:], later.start + drop, later.generated[drop:])


def tail_of(rows: mx.array | None, end: int, first_generated: int | None = None
            ) -> Tail | None:
    """A Tail of `rows` ending after conversation token `end - 1`; tokens from
    `first_generated` on were sampled by the model."""
    if rows is None:
        return None
    start = end - rows.shape[0]
    return Tail(rows, start, tuple(first_generated is not None and p + 1 >= first_generated
                                   for p in range(start, end)))


def tail_nll(model, rows: mx.array, targets: mx.array) -> mx.array:
    """(k,) NLL of token ids `targets` under the predictions `model` makes from final-norm
    `rows` (k, D): its output head on k rows."""
    logits = output_head(model)(rows).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -mx.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]


@dataclass(frozen=True)
class Reading:
    gap: float  # nats/token: target's mean NLL - the source's
    tokens: int  # tokens compared
    generated: float  # share of them the source had sampled itself
    target_nll: float
    source_nll: float


def compare(source_model, source: Tail | None, target_model, target: Tail | None,
            tokens: list[int], start: int, stop: int) -> Reading | None:
    """The gap over the tokens predicted from rows [start, stop) that both models hold (None
    when they share none). `tokens`: the conversation, so token p + 1 is what row p predicts."""
    if source is None or target is None:
        return None
    positions = [p for p in range(start, stop) if p + 1 < len(tokens)
                 and source.start <= p < source.end and target.start <= p < target.end]
    if not positions:
        return None
    targets = mx.array([tokens[p + 1] for p in positions])
    s = tail_nll(source_model, source.rows[mx.array([p - source.start for p in positions])],
                 targets)
    t = tail_nll(target_model, target.rows[mx.array([p - target.start for p in positions])],
                 targets)
    s_mean, t_mean = float(s.mean()), float(t.mean())
    share = sum(source.generated[p - source.start] for p in positions) / len(positions)
    return Reading(t_mean - s_mean, len(positions), share, t_mean, s_mean)


def threshold(calibration: dict | None, tail: int, generated: float, length: int
              ) -> tuple[float | None, str]:
    """(the threshold for a switch after `length` tokens whose tail of `tail` tokens the source
    had sampled a share `generated` of, why there is none)."""
    if not calibration:
        return None, "the translator has no gate calibration (calibrate_directory makes one)"
    if calibration.get("tail") != tail:
        return None, (f"the translator's gate is calibrated for a tail of "
                      f"{calibration.get('tail')} tokens, not {tail}")
    bands = calibration["bands"]
    t = next((b for b in bands if length <= b["prefix"][1]), bands[-1])["threshold"]
    return generated * t["generated"] + (1 - generated) * t["read"], ""


# -- calibration ------------------------------------------------------------------------------
def _as_loaded(name: str, model):
    from .models import LoadedModel

    return model if isinstance(model, LoadedModel) else LoadedModel(name, None, model, None, {})


def window_switch(translator, source, target, tokens: list[int], prefix: int, kind: str,
                  tail: int = GATE_TOKENS):
    """One held-out window through a `Session`, as a conversation meets the gate: the source
    reads `prefix` tokens (kind "read": the tail is text it read, and the next token is known)
    or reads them and writes `tail` + 1 more greedily (kind "generated"); then the switch.
    Returns the session: its switch (the gap in `gate_gap`) is `session.switches[-1]`."""
    from .session import Session

    session = Session({"source": _as_loaded("source", source),
                       "target": _as_loaded("target", target)},
                      {("source", "target"): translator}, active="source", gate_tokens=tail)
    session.add(tokens[:prefix])
    if kind == "read":
        list(session.generate(0))
        session.add(tokens[prefix:prefix + 1])
    else:
        list(session.generate(tail + 1))
    session.switch("target")
    return session


def _summary(gaps: list[float]) -> dict:
    a = np.asarray(gaps)
    return {"windows": len(gaps), "mean": round(float(a.mean()), 4),
            "std": round(float(a.std()), 4),
            **{f"q{int(q * 100)}": round(float(np.quantile(a, q)), 4) for q in (0.5, 0.9, 0.99)},
            "max": round(float(a.max()), 4)}


def calibrate(translator, source, target, token_ids: list[int], windows: int = WINDOWS,
              tail: int = GATE_TOKENS, bands=BANDS, seed: int = 0, quantile: float = QUANTILE,
              margin: float = MARGIN, progress=None) -> dict:
    """The gate's calibration of `translator` (source -> target: mlx-lm models or LoadedModels)
    on held-out `token_ids`: per band of prefix lengths, the gap over `windows` windows of each
    kind and per kind the threshold quantile + margin. The record a manifest keeps under
    "gate". `progress(done, total)` follows the windows. A text too short for a band cuts it
    short or leaves it out."""
    started = time.perf_counter()
    bare = replace(translator, info={k: v for k, v in translator.info.items() if k != "gate"})
    rng = random.Random(seed)
    longest = len(token_ids) - tail - 3  # a prefix, its tail and the next token fit
    shortest = max(min(lo for lo, _ in bands), 2 * tail + 1)
    if longest < shortest:
        raise KvtransError(f"held-out text has {len(token_ids)} tokens, too few to calibrate "
                           f"the gate on (at least {shortest + tail + 3})")
    bands = [(max(lo, 2 * tail + 1), min(hi, longest)) for lo, hi in bands if lo <= longest]
    digest = hashlib.sha256()
    record = {"tail": tail, "quantile": quantile, "margin": margin, "bands": []}
    total, done = windows * len(KINDS) * len(bands), 0
    for lo, hi in bands:
        gaps: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for i in range(windows * len(KINDS)):
            kind = KINDS[i % len(KINDS)]
            length = rng.randint(lo, hi)
            begin = rng.randrange(0, len(token_ids) - length - tail - 1)
            window = token_ids[begin:begin + length + tail + 2]
            digest.update(np.asarray(window, dtype=np.int32).tobytes())
            status = window_switch(bare, source, target, window, length, kind, tail).switches[-1]
            if status.gate_gap is not None:
                gaps[kind].append(status.gate_gap)
            done += 1
            if progress:
                progress(done, total)
        if not all(gaps.values()):
            raise KvtransError("no window could be compared: the gate needs a translator a "
                               "session can hand over with")
        record["bands"].append({
            "prefix": [lo, hi],
            "threshold": {k: round(float(np.quantile(g, quantile)) + margin, 4)
                          for k, g in gaps.items()},
            "gap": {k: _summary(g) for k, g in gaps.items()}})
    record.update(seed=seed, data_sha256=digest.hexdigest(),
                  seconds=round(time.perf_counter() - started, 2))
    return record


def calibrate_directory(directory: str | Path, text: str | Path | None = None,
                        **options) -> dict:
    """Calibrate the gate of a translator directory (or shipped name) on held-out text
    (default: the zoo corpus's validation split) and write it into its manifest; its weights
    are not touched. Returns the calibration."""
    from .models import held_out_split, load
    from .translators import artifact

    manifest = artifact.read_manifest(directory)
    source, target = load(manifest["source"]["name"]), load(manifest["target"]["name"])
    translator = artifact.load(directory, source, target)
    path = Path(text) if text is not None else held_out_split("validation")
    if path is None:
        raise KvtransError("no held-out text to calibrate on: give one, or build the zoo corpus")
    ids = source.tokenizer.encode(path.read_text(errors="replace"))
    record = calibrate(translator, source, target, ids, **options)
    artifact.update_manifest(directory, gate=record)
    return record
