"""A translator's fidelity frontier as a record: the settings of every fidelity knob, what was
measured of each (`Row`), the frontier saved as frontier.json beside the translator's weights,
and the choice of the cheapest setting that meets an agreement. Measuring it is
`evaluation/frontier.py`; choosing a session's setting from it is `session/dial.py`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import KvtransError
from ..files import sha256_file

FILE = "frontier.json"  # beside a translator's weights
FORMAT = "mlx-kvtrans-frontier"
GENERATED = 32  # continuation tokens compared
FLOOR_TOKENS = 16  # the floor reads only this many prompt tokens


# -- the knobs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One setting of every fidelity knob. A new knob is a new field with a default that
    leaves earlier frontiers' settings as they were."""
    reread: int = 0  # R: tokens the target reads itself over the translated prefix
    recompute: int = 0  # k: the target's first layers that read the translated prefix too

    def translated(self, prefix_length: int) -> int:
        """Tokens of a `prefix_length`-token prefix the translator builds (0: re-reading)."""
        return max(0, prefix_length - self.reread)

    def applies(self, length: int) -> bool:
        """Whether, at a prompt of `length` tokens, this setting still translates something."""
        return self.translated(length - 1) > 0

    def label(self) -> str:
        return f"R={self.reread}" + (f" k={self.recompute}" if self.recompute else "")

    def to_json(self) -> dict:  # an earlier frontier's settings read as they were written
        return {k: v for k, v in asdict(self).items() if k == "reread" or v}

    @classmethod
    def from_json(cls, data: dict) -> "Setting":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# the window of a manifest that records none: stage 1's default window
UNRECORDED_LENGTH = 256


def fitting_length(info: dict) -> int:
    """The longest prompt a translator was fitted (or distilled) on, from its manifest."""
    fit = info.get("fit") or {}
    distill = (info.get("distill") or {}).get("config") or {}
    lengths = list(fit.get("mix") or [fit.get("length")]) + [distill.get("max_prefix")]
    lengths = [n for n in lengths if n]
    return int(max(lengths)) if lengths else UNRECORDED_LENGTH


# -- the frontier ------------------------------------------------------------------------------
@dataclass
class Row:
    length: int
    setting: Setting
    windows: int
    agreement: float  # teacher-forced argmax agreement with the native greedy continuation
    agreement_last16: float  # the same, the target reading only the last 16 prompt tokens
    agreement_native: float  # native teacher-forced against its own greedy: numerics, ~1.0
    history_recovered: float | None
    greedy_match: float  # mean tokens of GENERATED equal to native's, generated greedily
    greedy_exact: float  # share of windows whose GENERATED tokens all equal native's
    first_token: float
    kl: float
    needles: int
    recall_native: float | None
    recall_translated: float | None
    reread_s: float
    switch_s: float
    applied: float | None = None  # through a session: the share of switches the gate let stand
    intervals: dict | None = None  # figure -> [low, high], 95% (evaluation/intervals.py)
    # per window, in window order: agreement and the floor's (for paired comparisons)
    window_agreement: list | None = None
    window_floor: list | None = None
    near_ties: float | None = None  # of the positions parted from native, the near ties' share

    @property
    def speedup(self) -> float:
        return self.reread_s / self.switch_s

    def to_json(self) -> dict:
        return {**asdict(self), "setting": self.setting.to_json(), "speedup": self.speedup}

    @classmethod
    def from_json(cls, data: dict) -> "Row":
        names = {f.name for f in fields(cls)}
        row = {k: v for k, v in data.items() if k in names}
        return cls(**{**row, "setting": Setting.from_json(data["setting"])})


def history_recovered(agreement: float, floor: float) -> float | None:
    return None if floor >= 1.0 else (agreement - floor) / (1.0 - floor)


@dataclass
class Frontier:
    """The rows measured of one translator, and how they were measured."""
    translator: str  # its directory name
    source: str
    target: str
    fit_length: int
    rows: list[Row]
    settings: dict = field(default_factory=dict)  # prompts, needles, repeats, seed, text, ...
    weights_sha256: str | None = None  # of the translator's weights.safetensors

    def to_json(self) -> dict:
        return {"format": FORMAT, "translator": self.translator, "source": self.source,
                "target": self.target, "fit_length": self.fit_length,
                "weights_sha256": self.weights_sha256, "settings": self.settings,
                "generated": GENERATED, "floor_tokens": FLOOR_TOKENS,
                "rows": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, data: dict) -> "Frontier":
        return cls(data["translator"], data["source"], data["target"], data["fit_length"],
                   [Row.from_json(r) for r in data["rows"]], data.get("settings", {}),
                   data.get("weights_sha256"))


# -- choosing a setting --------------------------------------------------------------------------
def rows_at(frontier, length: int) -> list[Row]:
    """The rows measured at the shortest length at or past `length` (agreement falls with
    length, so a longer one is the cautious reading); none past every measured length."""
    rows = frontier.rows if isinstance(frontier, Frontier) else list(frontier)
    shortest = min((r.length for r in rows if r.length >= length), default=None)
    return [r for r in rows if r.length == shortest]


def cheapest_row(frontier, agreement: float, length: int, min_speedup: float = 1.0
                 ) -> Row | None:
    """The row of the fastest setting whose held-out agreement is at least `agreement` at a
    switch of `length` tokens; None if none is, or none beats re-reading (`min_speedup`).

    The rows read are `rows_at(frontier, length)`; past every measured length nothing is
    known and None is returned."""
    meeting = [r for r in rows_at(frontier, length)
               if r.agreement >= agreement and r.speedup > min_speedup]
    return max(meeting, key=lambda r: r.speedup, default=None)


def cheapest(frontier, agreement: float, length: int, min_speedup: float = 1.0
             ) -> Setting | None:
    """The setting of `cheapest_row` (None: re-reading)."""
    row = cheapest_row(frontier, agreement, length, min_speedup)
    return None if row is None else row.setting


# -- frontier.json -------------------------------------------------------------------------------
def _file(path) -> Path:
    path = Path(path)
    return path / FILE if path.is_dir() else path


def save(frontier: Frontier, path, force: bool = False) -> Path:
    """Write `frontier` as `path` (a file, or frontier.json in a translator directory);
    an existing file is replaced only with `force`."""
    path = _file(path)
    if path.exists() and not force:
        raise KvtransError(f"{path} already exists (pass --force to replace it)")
    path.write_text(json.dumps(frontier.to_json(), indent=2) + "\n")
    return path


def load(path) -> Frontier:
    """The frontier saved at `path` (a file, or a translator directory holding one). In a
    translator directory it must have been measured of the weights there."""
    file = _file(path)
    if not file.is_file():
        raise KvtransError(f"{path}: no {FILE} (measure one with `kvtrans eval frontier "
                           "--record`)")
    try:
        data = json.loads(file.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT} file")
        if any("reread_s" not in row for row in data.get("rows", [])):
            raise ValueError("recorded by an earlier version of mlx-kvtrans, whose rows name "
                             "their figures otherwise: measure it again with `--record --force`")
        frontier = Frontier.from_json(data)
        if not frontier.rows:
            raise ValueError("no rows")
        for row in frontier.rows:  # what a switch will compare and divide
            if not all(isinstance(v, (int, float)) for v in
                       (row.length, row.agreement, row.reread_s, row.switch_s)) \
                    or row.switch_s <= 0 or row.setting.reread < 0:
                raise ValueError(f"a row is not measured figures: {row.to_json()}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise KvtransError(f"{file}: not a readable frontier ({type(e).__name__}: {e})")
    weights = file.parent / "weights.safetensors"
    if weights.is_file() and frontier.weights_sha256 not in (None, sha256_file(weights)):
        raise KvtransError(f"{file} was measured of other weights than {weights}: measure "
                           "it again")
    return frontier
