"""The fidelity dial: how many of a span's last tokens the target re-reads itself at a switch
(R), and how many of its first layers read the translated span themselves (k, `recompute`).

The target reads the last R tokens of what it receives over the translated prefix (R = 0: the
translation covers everything, the gate's r tokens aside). More R costs time and buys fidelity;
each translator's frontier (`translators/frontier.py`, frontier.json beside its weights) says how
much of both, per length, on held-out data. A session asks for one of:

- `reread=R`: that R at every switch;
- `fidelity=a`: the cheapest measured R whose held-out teacher-forced agreement is at least `a`
  at the switch's length (none: the target re-reads the span, with the reason);
- neither: the translator's default, the cheapest setting that meets `DEFAULT_AGREEMENT` at
  twice its fitting length (none meets it: the most faithful measured there); R = 0 without a
  frontier.

The frontier's rows are settings of both knobs, so `fidelity` and the default pick k with R
where the frontier measured k (`eval frontier --recompute`); a session's `recompute` fixes it.

With `Session(escalate=True)`, a switch whose gate fired tries once more with `ESCALATION`
times the tokens re-read before it re-reads the span (a translation can err on the first
tokens the target reads, and a few more read natively mend that), judged by the gate again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..translators.frontier import Setting, cheapest_row, fitting_length, rows_at

DEFAULT_AGREEMENT = 0.9  # the default setting meets this agreement at 2x the fitting length
# a switch whose gate fired re-reads this many times as many tokens before re-reading
ESCALATION = 4


@dataclass(frozen=True)
class Choice:
    """The setting a switch runs with, and what its translator's frontier expects of it."""
    reread: int
    expected_agreement: float | None = None  # held-out teacher-forced agreement
    expected_speedup: float | None = None  # warm switch over re-reading, as measured
    note: str = ""
    recompute: int = 0  # k: the target's first layers that read the translated span


def problem(reread: int | None, fidelity: float | None, prefix: str = "") -> str:
    """What is wrong with asking for `reread` and `fidelity` ("" if nothing); `prefix` names
    them as options ("--")."""
    if reread is not None and fidelity is not None:
        return f"give {prefix}reread or {prefix}fidelity, not both"
    if reread is not None and reread < 0:
        return f"{prefix}reread {reread}: must be 0 or more"
    if fidelity is not None and not 0.0 < fidelity <= 1.0:
        return f"{prefix}fidelity {fidelity}: an agreement in (0, 1]"
    return ""


def _expecting(frontier, setting: Setting, length: int, note: str) -> Choice:
    row = None if frontier is None else next(
        (r for r in rows_at(frontier, length) if r.setting == setting), None)
    if row is None:
        return Choice(setting.reread, note=note, recompute=setting.recompute)
    return Choice(setting.reread, row.agreement, row.speedup, note, setting.recompute)


def expecting(translator, reread: int, length: int, recompute: int = 0) -> Choice:
    """What the translator's frontier expects of `reread` (and `recompute`) at `length` tokens
    (nothing where it measured no such row)."""
    return _expecting(getattr(translator, "frontier", None), Setting(reread, recompute),
                      length, "")


def escalated(read: int, span: int) -> int | None:
    """After the gate fired on a switch whose target read `read` of the `span` tokens it was
    given: the wider re-read to try before re-reading the span, or None where that would
    read half the span or more (a full re-read then costs little more)."""
    wider = ESCALATION * read
    return wider if wider < span / 2 else None


def default_reread(translator) -> tuple[int, str]:
    """(R, how it was chosen) for a translator's switches when the session names none."""
    setting, how = default_setting(translator)
    return setting.reread, how


def default_setting(translator, recompute: int | None = None) -> tuple[Setting, str]:
    """(the setting, how it was chosen) for a translator's switches when the session names
    none (`recompute`: among the settings of that k)."""
    frontier, info = getattr(translator, "frontier", None), getattr(translator, "info", {})
    if frontier is None:
        return Setting(0, recompute or 0), info.get("frontier_problem") or "no frontier measured"
    rows = frontier.rows if hasattr(frontier, "rows") else list(frontier)
    if recompute is not None:
        frontier = rows = [r for r in rows if r.setting.recompute == recompute]
    # twice the longest prompt it learned from; one fitted on the longest lengths measured
    # reads at the longest
    at = min(2 * fitting_length(info), max((r.length for r in rows), default=0))
    row = cheapest_row(frontier, DEFAULT_AGREEMENT, at)
    if row is not None:
        return row.setting, f"default: agreement >= {DEFAULT_AGREEMENT} at {at} tokens"
    measured = rows_at(frontier, at)
    if not measured:
        return Setting(0, recompute or 0), f"default: no frontier row at {at} tokens"
    best = max(measured, key=lambda r: (r.agreement, r.speedup))
    return best.setting, (f"default: no setting reaches {DEFAULT_AGREEMENT} at {at} "
                          "tokens; the most faithful measured")


def choose(translator, length: int, reread: int | None, fidelity: float | None,
           recompute: int | None = None) -> tuple[Choice | None, str]:
    """The setting for a switch of `length` tokens, or (None, why) when the target should
    re-read instead (`fidelity` asked and no measured setting reaches it). `recompute`: k
    fixed (None: as the frontier's chosen row has it, else 0)."""
    frontier = getattr(translator, "frontier", None)
    if frontier is not None and recompute is not None:  # only rows of that k to choose among
        frontier = [r for r in frontier.rows if r.setting.recompute == recompute]
    if fidelity is not None:
        if frontier is None:
            return None, (f"fidelity {fidelity:g} asked, and the translator has no measured "
                          "frontier: " + (getattr(translator, "info", {}).get(
                              "frontier_problem") or "kvtrans eval frontier --record"))
        row = cheapest_row(frontier, fidelity, length)
        if row is None:
            longest = max((r.length for r in _rows(frontier)), default=0)
            why = (f"measured only up to {longest} tokens" if length > longest else
                   "no measured setting reaches it faster than re-reading")
            return None, f"fidelity {fidelity:g} at {length} tokens: {why}"
        return Choice(row.setting.reread, row.agreement, row.speedup,
                      f"fidelity {fidelity:g}", row.setting.recompute), ""
    if reread is not None:
        return _expecting(frontier, Setting(reread, recompute or 0), length, "reread asked"), ""
    setting, how = default_setting(translator, recompute)
    return _expecting(frontier, setting, length, how), ""


def _rows(frontier) -> list:
    return frontier.rows if hasattr(frontier, "rows") else list(frontier)
