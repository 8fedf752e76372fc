"""How long `kvtrans fit` takes on this machine, measured on the two models rather than
projected from peak rates.

A fit is a capture pass (each batch prefilled through both models, its moments accumulated),
a solve, and the fidelity gate's calibration (whole held-out window switches, `calibrate`). The
matmul rate alone misleads: small models are bound by per-layer overheads, not FLOPs. So
`fit_time` runs the real thing briefly: `fit` on one batch of random ids (capture, accumulate,
solve) and the calibration's `window_switch` of each kind with the translator it returns, and
scales those by the fit's batches and windows. A config-only model
(`models.load_config_only`) times as its checkpoint would, since time does not depend on the
weights' values. Models past TIMED_PARAMETERS are not run (building their weights alone takes
long): they are projected at the matmul rate.

It sits beside `calibrate`, above both stages, since it runs a session's switch.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import mlx.core as mx

from .calibrate import BANDS, WINDOWS, window_switch
from ..errors import KvtransError
from ..translators.gate import GATE_TOKENS, KINDS
from .cost import PlanCost, active_parameters, format_duration, parameter_count
from ..models import input_embedding
from .fit import FIT_BATCH, FitConfig, fit

TIMED_PARAMETERS = 200_000_000
LONGEST_FIT = 365 * 86400.0  # a plan projecting more is refused: no one means to wait that long


@dataclass
class FitTime:
    """Seconds `kvtrans fit` spends here, by stage. `measured`: timed on the two models (else
    projected at the matmul rate)."""
    capture_seconds: float  # every fitting batch: prefill and capture of both models, moments
    solve_seconds: float
    gate_seconds: float  # calibrating the fidelity gate: held-out window switches
    measured: bool

    @property
    def seconds(self) -> float:
        return self.capture_seconds + self.solve_seconds + self.gate_seconds

    def to_json(self) -> dict:
        return {**asdict(self), "seconds": self.seconds}


REPEATS = 3  # each timing is the fastest of these runs: another job's load only slows a run


def _timed(run) -> float:
    fastest = math.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def _calibration_windows(windows: int) -> tuple[int, int]:
    """(window switches a calibration of `windows` per kind and band runs, their mean prefix)."""
    lengths = [(max(lo, 2 * GATE_TOKENS + 1) + hi) / 2 for lo, hi in BANDS]
    return windows * len(KINDS) * len(BANDS), round(sum(lengths) / len(lengths))


def fit_time(source_lm, target_lm, cost: PlanCost, config: FitConfig,
             tokens: int | None = None, gate_windows: int = WINDOWS,
             timed: bool = True) -> FitTime:
    """What `kvtrans fit` with `config` over `tokens` fitting tokens (default: its windows x
    length) takes here, the gate's calibration over `gate_windows` included. Timing the zoo's
    models takes a few seconds; without `timed` (a plan for another machine) it is projected
    at `cost`'s matmul rate."""
    tokens = config.windows * config.length if tokens is None else tokens
    batches = math.ceil(tokens / (FIT_BATCH * config.length))
    windows, prefix = _calibration_windows(gate_windows)
    if timed and all(parameter_count(lm.model) <= TIMED_PARAMETERS
                     for lm in (source_lm, target_lm)):
        source, target = source_lm.model, target_lm.model
        # ids both models read (across tokenizers a token costs the same whichever it is)
        vocab = min(input_embedding(m).weight.shape[0] for m in (source, target))
        width = max(config.length, prefix + 2 * GATE_TOKENS)
        ids = mx.random.randint(0, vocab, (FIT_BATCH, width))
        batch = ids[:, :config.length]
        fit(source, target, [batch[:, :16]], config=config)  # warm-up: weights, kernels
        translator = None

        def one_batch():
            nonlocal translator
            translator = fit(source, target, [batch], config=config)

        per_batch = _timed(one_batch)  # its solve is the plan's, counted apart
        row = ids[0].tolist()
        window_switch(translator, source, target, row, prefix, KINDS[0])  # warm-up
        per_window = sum(_timed(lambda: window_switch(translator, source, target, row, prefix,
                                                      kind)) for kind in KINDS) / len(KINDS)
        return FitTime(batches * max(per_batch - cost.solve_seconds, 0.0), cost.solve_seconds,
                       windows * per_window, True)
    rate = cost.gflops * 1e9
    flops = [2.0 * active_parameters(lm) for lm in (source_lm, target_lm)]
    accumulate = sum(2.0 * f.inputs * (f.inputs + f.outputs) for f in cost.feature_sets)
    per_window = (prefix * (flops[0] + cost.translation_flops_per_token)
                  + (GATE_TOKENS + 1) * flops[1]) / rate
    return FitTime(tokens * (sum(flops) + accumulate) / rate, cost.solve_seconds,
                   windows * per_window, False)


def refuse_a_fit_too_long(time: FitTime, tokens: int) -> None:
    """A plan whose fit would outlast LONGEST_FIT is bad input (a typo in the tokens, or the
    wrong machine for this pair), not a projection to print."""
    if not time.seconds <= LONGEST_FIT:
        raise KvtransError(f"--tokens {tokens:,}: the fit would take about "
                           f"{format_duration(time.seconds)} on that machine; plan one of at most "
                           "a year")
