"""Stage 2: distil a translator end to end against the target reading its own cache.

Loss (hybrid-translation paper, stage 2): the mean over continuation positions of
KL(p_T(. | native cache, cont<i) || p_T(. | translated cache, cont<i)), with gradients flowing
through the frozen target into every translator parameter (maps, token-identity columns, state
corrections, replay maps). Source and target never change. Rehearsals (`rehearsal.py`) add
weighted losses of their own against the target reading its own cache: a DSA target's indexer
scores (its keys get no gradient through the top-k otherwise), per-head attention, each layer's
token-mixer output (Heo et al. find its agreement predicts what a transfer keeps) and each
per-token object the translator builds.

What a user sees: `greedy` continues each window with the target's own greedy tokens (the
frontier's agreement is taken on them); `reread` = R and `sink` = S leave the prefix's last R
and first S tokens to the target, as a session does; `temperature` below 1 weighs the order of
the likeliest tokens; `train_only` trains only the parameters named so (a residual beside a
closed form it must not move); `keep` best keeps those of the lowest validation KL measured.

Which parameters move is measured on the pair by default (`train_only="auto"`): every one, unless
the first held-out KL is above the start's. Then the run starts again from its start (the closed
form, for a stage-1 translator) with the biases alone. Between real pretrained models Adam's
equal-sized steps on every entry of a map, summed over features of large magnitude, move the
target's reading too far: held-out KL rises from the third step at 1e-4, and at 1e-6 falls 8%
before rising, while the biases alone descend steadily. The zoo's small models improve under
every parameter (docs/negative-results.md, "Stage 2 between real members").

Recurrences run through the chunkwise-parallel gated delta rule (it has a backward pass on every
device; the Metal kernel has none). Each step's batch depends only on (seed, step), and the
parameters and Adam state are checkpointed, so a resumed run continues bit-identically. Under
`mlx.launch` each process takes its share of the same global batch and gradients are averaged.
Corpus text rarely asks the target to copy a fact from far back, which exact recall needs:
`needle_share` replaces that share of every batch with synthetic needles (training seeds) whose
continuation ends with the question and the answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..capture.instrument import chunked_recurrence
from ..errors import KvtransError
from ..translators.translator import Translator, measured_sink
from .problem import Problem, ProblemConfig

@dataclass(frozen=True)
class DistillConfig:
    steps: int = 300
    lr: float = 1e-4  # Adam; the maps start from the closed-form solution
    warmup: int = 20
    batch: int = 8  # global batch: rows per step, over all processes
    min_prefix: int = 32
    max_prefix: int = 256  # prefix lengths are drawn from [min_prefix, max_prefix] per step
    continuation: int = 32  # positions the KL is taken over
    indexer_weight: float = 1.0
    attention_weight: float = 0.0  # the attention rehearsal's weight (0: off)
    output_weight: float = 0.0  # the output rehearsal's weight (0: off)
    object_weight: float = 0.0  # the object rehearsal's weight (0: off; rehearsal.py)
    temperature: float = 1.0  # the KL's; below 1 it weighs the ordering of the top tokens
    # train only the parameters whose names hold this (e.g. residual); "" every one; auto: every
    # one unless the first validation is worse than the start, then the biases from the start
    train_only: str = "auto"
    keep: str = "last"  # or best: the parameters of the lowest validation KL, start included
    needle_share: float = 0.0  # share of each batch's rows that are needles, answer at the end
    needle_form: str = "text"  # or chat: the needles in the target's chat template
    greedy: bool = False  # continue with the target's own greedy tokens (sequence level)
    reread: int = 0  # the target reads the prefix's last R tokens itself, as a session's dial
    sink: int | None = None  # and its first S (None: as its fit measured, `measured_sink`)
    validate_every: int = 50
    validation_windows: int = 16
    seed: int = 0
    max_minutes: float | None = None  # stop after this long, checkpointed: a rerun resumes

    def __post_init__(self):
        if self.min_prefix > self.max_prefix:
            raise KvtransError("--min-prefix must not exceed --max-prefix")
        if self.keep not in KEEP:
            raise KvtransError(f"--keep must be {' or '.join(KEEP)}, not {self.keep!r}")
        if self.needle_form not in NEEDLE_FORMS:
            raise KvtransError(f"--needle-form must be {' or '.join(NEEDLE_FORMS)}, not "
                               f"{self.needle_form!r}")
        if not self.temperature > 0:
            raise KvtransError("--temperature must be above 0")
        if self.reread + (self.sink or 0) >= self.min_prefix:
            raise KvtransError("--reread and --sink together must be below --min-prefix: every "
                               "prefix is partly translated")

    def fingerprint(self) -> str:
        """What a checkpoint must match to resume: every setting but `keep`, which only
        chooses among the parameters a run holds (a finished run resumes to write the other),
        and `max_minutes`, which only says when this run stops."""
        fields = {k: v for k, v in asdict(self).items()
                  if k not in ("keep", "max_minutes") and (  # settings added
                  k not in LATER_DEFAULTS or LATER_DEFAULTS[k] != v)}  # later, at their defaults
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


LATER_DEFAULTS = {"greedy": False, "reread": 0, "sink": 0, "output_weight": 0.0,
                  "object_weight": 0.0, "temperature": 1.0, "train_only": "",
                  "needle_form": "text"}
KEEP = ("last", "best")
NEEDLE_FORMS = ("text", "chat")
AUTO, FALLBACK = "auto", "bias"  # what `auto` trains where every parameter makes things worse


def frozen(names, train_only: str) -> set[str]:
    """The parameters `--train-only` holds as they are: those whose names lack its text
    (none for "" and, until its first validation says otherwise, for auto)."""
    held = {k for k in names if train_only not in k} if train_only not in ("", AUTO) else set()
    if train_only and len(held) == len(names):
        raise KvtransError(f"--train-only {train_only}: no parameter of the translator is named "
                           "so (residual needs `kvtrans fit --residual`)")
    return held


def start_fingerprint(translator: Translator) -> str:
    """A hash of the parameters a run starts from: a checkpoint continues only its own start (a
    refitted translator, or one fitted to a retrained model, starts afresh)."""
    digest = hashlib.sha256()
    for key in sorted(translator.params):
        digest.update(key.encode())
        digest.update(np.asarray(translator.params[key].astype(mx.float32)).tobytes())
    return digest.hexdigest()[:16]


def _schedule(config: DistillConfig):
    warm = optim.linear_schedule(config.lr * 0.01, config.lr, max(1, config.warmup))
    decay = optim.cosine_decay(config.lr, max(1, config.steps - config.warmup), config.lr * 0.1)
    return optim.join_schedules([warm, decay], [max(1, config.warmup)])


def draw_windows(ids, step: int, config: DistillConfig, needles=None) -> tuple[mx.array, int]:
    """(global batch of windows (batch, prefix + continuation), prefix length) of `step`: corpus
    windows, and the `needle_share` of rows as needle ends (question and answer last)."""
    rng = random.Random(config.seed * 1_000_003 + step)
    prefix = rng.randint(config.min_prefix, config.max_prefix)
    span = prefix + config.continuation
    if len(ids) < span + 1:
        raise KvtransError(f"the distillation text has {len(ids)} tokens, fewer than one "
                           f"window of {span}")
    n_needles = round(config.batch * config.needle_share)
    starts = [rng.randrange(0, len(ids) - span) for _ in range(config.batch - n_needles)]
    rows = [ids[s:s + span] for s in starts]
    if n_needles:
        rows += [row[-span:] for row in rng.sample(needles, n_needles)]
    return mx.array(rows), prefix


MAX_SKIPPED = 10  # steps in a row with non-finite gradients before a run stops
# what a checkpoint directory holds (each also as the .tmp it is written to first): nothing
# else is ever written there
CHECKPOINT_FILES = ("params.safetensors", "optimizer.safetensors", "best.safetensors",
                    "state.json", "params.safetensors.tmp.safetensors",
                    "optimizer.safetensors.tmp.safetensors", "best.safetensors.tmp.safetensors",
                    "state.json.tmp")


class Distiller:
    """The stage-2 loop: Adam with warm-up and cosine decay, validation KL, checkpoints."""

    def __init__(self, translator: Translator, source, target, train_ids, validation_ids,
                 config: DistillConfig, workdir: Path, group=None,
                 needles: list[list[int]] | None = None, tokenizers: tuple | None = None):
        if "alignment" in translator.info and tokenizers is None:
            raise KvtransError("distilling a translator across tokenizers needs the two "
                               "tokenizers (the windows are the target's tokens)")
        self.translator = translator
        self.source = source
        self.target = target
        self.tokenizers = tokenizers  # (source's, target's) across tokenizers
        if config.needle_share and not needles:
            raise KvtransError("needle_share needs needle rows (workflows.training_needles)")
        if needles and min(len(r) for r in needles) < config.max_prefix + config.continuation:
            raise KvtransError("needle rows must be at least max_prefix + continuation tokens")
        self.needles = needles
        self.train_ids, self.validation_ids = list(train_ids), list(validation_ids)
        config = replace(config, sink=measured_sink(translator)) if config.sink is None else config
        self.config, self.workdir = config, Path(workdir)
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1
        if config.batch % self.size:
            raise KvtransError(f"the batch ({config.batch}) must divide among {self.size} "
                               "processes")
        self.params = translator.parameters()  # a tree: Adam, checkpoints, all-reduce
        self.frozen = frozen(translator.params, config.train_only)
        self.optimizer = optim.Adam(learning_rate=_schedule(config))
        self.optimizer.init(self.params)
        self.state = {"step": 0, "seconds": 0.0, "config": config.fingerprint(),
                      "start": start_fingerprint(translator), "history": [],
                      "trained": None if config.train_only == AUTO else config.train_only}
        self._validation = None
        self.best_params, self.best_unsaved = None, False  # lowest validation KL (keep best)

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self):
        if self.rank != 0:
            return
        # each file whole or not at all: a run stopped while saving resumes from the last save
        # (or, stopped between the renames, from newer weights under an older step count)
        self.workdir.mkdir(parents=True, exist_ok=True)
        written = {"params.safetensors": dict(tree_flatten(self.params)),
                   "optimizer.safetensors": dict(tree_flatten(self.optimizer.state))}
        if self.best_unsaved:  # the file holds it already otherwise
            written["best.safetensors"] = dict(tree_flatten(self.best_params))
        for name, arrays in written.items():
            mx.save_safetensors(str(self.workdir / f"{name}.tmp.safetensors"), arrays)
        tmp = self.workdir / "state.json.tmp"
        tmp.write_text(json.dumps(self.state))
        for name in written:
            (self.workdir / f"{name}.tmp.safetensors").replace(self.workdir / name)
        tmp.replace(self.workdir / "state.json")
        self.best_unsaved = False

    def resume(self) -> bool:
        """Load the checkpoint in `workdir` if there is one; refuse one of another config."""
        path = self.workdir / "state.json"
        if not path.exists():
            return False
        state = json.loads(path.read_text())
        every = replace(self.config, train_only="").fingerprint()
        if self.config.train_only == AUTO and state.get("config") == every:
            state["config"], state["trained"] = self.config.fingerprint(), ""  # before auto
        if state.get("config") != self.config.fingerprint():
            raise KvtransError(f"the checkpoint in {self.workdir} was made with other settings; "
                               "use the same ones to resume, or another --workdir")
        state.setdefault("trained", self.state["trained"])  # written before auto: as set
        if state.get("start") != self.state["start"]:
            raise KvtransError(f"the checkpoint in {self.workdir} started from another "
                               "translator; resume it from that one, or use another --workdir")
        self.state = state
        if state.get("trained"):  # auto's choice, made before the checkpoint
            self.frozen = frozen(self.translator.params, state["trained"])
        self.params = tree_unflatten(list(mx.load(str(self.workdir / "params.safetensors")).items()))
        self.optimizer.state = tree_unflatten(
            list(mx.load(str(self.workdir / "optimizer.safetensors")).items()))
        if state.get("best", {}).get("step"):
            self.best_params = tree_unflatten(
                list(mx.load(str(self.workdir / "best.safetensors")).items()))
        return True

    # -- measuring ---------------------------------------------------------------------------
    def validation_problems(self) -> list[Problem]:
        """Fixed held-out windows at the longest prefix (the same every time)."""
        if self._validation is None:
            c = self.config
            rng = random.Random(c.seed + 7_777)
            span = c.max_prefix + c.continuation
            if len(self.validation_ids) < span + 1:
                raise KvtransError(f"the validation text has {len(self.validation_ids)} tokens, "
                                   f"fewer than one window of {span}")
            starts = [rng.randrange(0, len(self.validation_ids) - span)
                      for _ in range(c.validation_windows)]
            windows = mx.array([self.validation_ids[s:s + span] for s in starts])
            with chunked_recurrence():
                self._validation = [
                    Problem(self.translator, self.source, self.target, windows[i:i + c.batch],
                            c.max_prefix, ProblemConfig(greedy=c.greedy, reread=c.reread,
                                                        sink=c.sink), self.tokenizers)
                    for i in range(0, len(starts), c.batch)]
        return self._validation

    def validate(self, params=None) -> float:
        """Mean held-out KL (nats/token) of `params` (default: the current ones)."""
        params = self.params if params is None else params
        with chunked_recurrence():
            kls = [float(p.loss(params)[1][0]) * len(p.inputs)
                   for p in self.validation_problems()]
        return sum(kls) / self.config.validation_windows

    # -- training ----------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        windows, prefix = draw_windows(self.train_ids, step, self.config, self.needles)
        share = windows[self.rank::self.size]
        with chunked_recurrence():
            c = self.config
            reading = ProblemConfig(attention=c.attention_weight > 0,
                                    outputs=c.output_weight > 0, objects=c.object_weight > 0,
                                    greedy=c.greedy, reread=c.reread, sink=c.sink)
            problem = Problem(self.translator, self.source, self.target, share, prefix, reading,
                              self.tokenizers)
            (loss, (kl, rehearsal, attention, outputs, built)), grads = mx.value_and_grad(
                lambda p: problem.loss(p, c.indexer_weight, c.attention_weight,
                                       c.output_weight, c.object_weight,
                                       c.temperature))(self.params)
        if self.frozen:  # plain Adam (no decay) leaves a parameter of zero gradients where it is
            grads = tree_unflatten([(k, mx.zeros_like(g) if k in self.frozen else g)
                                    for k, g in tree_flatten(grads)])
        if self.size > 1:
            grads = nn.average_gradients(grads, group=self.group)
            loss, kl, rehearsal, attention, outputs, built = (
                mx.distributed.all_sum(x, group=self.group) / self.size
                for x in (loss, kl, rehearsal, attention, outputs, built))
        finite = mx.isfinite(loss)
        for _, g in tree_flatten(grads):
            finite = finite & mx.all(mx.isfinite(g))
        skipped = not finite.item()  # one bad step must not make every parameter NaN
        if not skipped:
            self.params = self.optimizer.apply_gradients(grads, self.params)
        mx.eval(self.params, self.optimizer.state, loss, kl, rehearsal, attention, outputs,
                built)
        return {"step": step + 1, "prefix": prefix, "loss": float(loss), "kl": float(kl),
                "indexer_rehearsal": float(rehearsal), "attention_rehearsal": float(attention),
                **({"output_rehearsal": float(outputs)} if c.output_weight else {}),
                **({"object_rehearsal": float(built)} if c.object_weight else {}),
                **({"skipped": True} if skipped else {})}

    def run(self, on_step=None, checkpoint_seconds: float = 120.0, max_minutes=None) -> dict:
        """Train to `config.steps` (from the checkpoint if resumed); returns the summary."""
        c = self.config
        mx.clear_cache()  # buffers reused from the cache would not count towards the peak
        mx.reset_peak_memory()
        if "validation_kl_before" not in self.state:
            self.state["validation_kl_before"] = self.validate(self.translator.parameters())
        self.state.setdefault("best", {"step": 0,
                                       "validation_kl": self.state["validation_kl_before"]})
        started = time.perf_counter() - self.state["seconds"]
        last_save = time.perf_counter()
        in_a_row = 0
        while self.state["step"] < c.steps:
            record = self.step(self.state["step"])
            self.state["step"] = record["step"]
            in_a_row = in_a_row + 1 if record.get("skipped") else 0
            if in_a_row >= MAX_SKIPPED:
                self.state["history"].append(record)
                self.save_checkpoint()
                raise KvtransError(
                    f"distillation stopped at step {record['step']}: {in_a_row} steps in a row "
                    f"gave non-finite gradients (prefix {record['prefix']} the last); the "
                    f"checkpoint in {self.workdir} holds the last finite parameters: try a "
                    "lower --lr or --max-prefix")
            if record["step"] % c.validate_every == 0 or record["step"] == c.steps:
                record["validation_kl"] = self.validate()
                if self.state.get("trained") is None and self.choose_trained(record):
                    continue
                if record["validation_kl"] < self.state["best"]["validation_kl"]:
                    self.state["best"] = {k: record[k] for k in ("step", "validation_kl")}
                    self.best_params, self.best_unsaved = self.params, True
            record["seconds"] = round(time.perf_counter() - started, 2)
            # kept in the checkpoint, so a resumed run reports the whole run's peak
            self.state["peak_memory_bytes"] = max(self.state.get("peak_memory_bytes", 0),
                                                  mx.get_peak_memory())
            self.state["history"].append(record)
            self.state["seconds"] = time.perf_counter() - started
            if on_step:
                on_step(record)
            if (time.perf_counter() - last_save > checkpoint_seconds
                    or record["step"] == c.steps):
                self.save_checkpoint()
                last_save = time.perf_counter()
            if max_minutes and time.perf_counter() - started > max_minutes * 60:
                self.save_checkpoint()
                break
        return self.summary()

    def choose_trained(self, record: dict) -> bool:
        """`auto` at its first validation: keep training every parameter where the held-out KL
        fell, else start again from the start with the biases alone (True: restarted)."""
        worse = not record["validation_kl"] <= self.state["validation_kl_before"]  # or NaN
        if self.size > 1:  # one choice for every process: the run must stay one run
            worse = mx.distributed.all_sum(mx.array(float(worse)), group=self.group).item() > 0
        if not worse or not any(FALLBACK in k for k in self.translator.params):
            self.state["trained"] = ""
            return False
        self.state["trained"] = FALLBACK
        self.state["probe"] = self.state["history"] + [record]  # what every parameter did
        self.state["history"], self.state["step"] = [], 0
        self.frozen = frozen(self.translator.params, FALLBACK)
        self.params = self.translator.parameters()
        self.optimizer = optim.Adam(learning_rate=_schedule(self.config))
        self.optimizer.init(self.params)
        self.save_checkpoint()  # a stop from here on resumes the biases' run
        return True

    def summary(self) -> dict:
        validated = [r for r in self.state["history"] if "validation_kl" in r]
        probe = self.state.get("probe")
        return {"stage": 2, "steps": self.state["step"], "config": asdict(self.config),
                "trained": self.state.get("trained") or "all",
                **({"probe": [{k: r[k] for k in ("step", "kl", "validation_kl") if k in r}
                              for r in probe]} if probe else {}),
                "minutes": round(self.state["seconds"] / 60, 2), "processes": self.size,
                "validation_kl_before": self.state.get("validation_kl_before"),
                "best": self.state.get("best"),  # what `keep` best returns
                "validation_kl_after": validated[-1]["validation_kl"] if validated else None,
                "peak_memory_bytes": self.state.get("peak_memory_bytes", mx.get_peak_memory()),
                "curve": [{k: r[k] for k in ("step", "loss", "kl", "indexer_rehearsal",
                                             "attention_rehearsal", "validation_kl") if k in r}
                          for r in self.state["history"]]}

    def kept_params(self):
        """The parameters the run returns (`keep`): the last step's, or the best validated."""
        if self.config.keep == "last":
            return self.params
        return self.best_params if self.best_params is not None else \
            self.translator.parameters()

    def distilled(self) -> Translator:
        """The translator with the distilled parameters (in the closed-form dtype); the stage-1
        gate calibration does not carry over (`calibrate.calibrate` measures one anew)."""
        trained = dict(tree_flatten(self.kept_params()))
        params = {k: trained[k].astype(v.dtype) for k, v in self.translator.params.items()}
        info = {k: v for k, v in self.translator.info.items() if k != "gate"}
        return replace(self.translator, params=params, info=info)


def distill(translator: Translator, source, target, train_ids, validation_ids,
            config: DistillConfig = DistillConfig(), workdir: str | Path | None = None,
            resume: bool = False, needles: list[list[int]] | None = None, on_step=None,
            tokenizers: tuple | None = None) -> Translator:
    """Stage 2 in one call: distil `translator` (mlx-lm models `source` -> `target`) on token ids
    (the target's; across tokenizers, `tokenizers` = (source's, target's) and the source reads
    its own tokens of each window's text) and return the distilled translator, its manifest
    recording the run. It has no gate calibration (`calibrate.calibrate` adds one;
    `workflows.distill_translator` does what `kvtrans distill` does, calibration included)."""
    import tempfile

    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtrans-distill-"))
        run = Distiller(translator, source, target, train_ids, validation_ids, config, workdir,
                        needles=needles, tokenizers=tokenizers)
        if resume:
            run.resume()
        summary = run.run(on_step=on_step)
        distilled = run.distilled()
    distilled.info["stage"] = 2
    distilled.info["distill"] = summary
    return distilled
