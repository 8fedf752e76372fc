"""Healing a converted model: distil the parent's next-token distributions into it (KL, teacher
forcing on windows of text), resumable.

Step s reads windows [s * batch, (s + 1) * batch) of a fixed array, so a run stopped and resumed
from its last checkpoint (trainable parameters, optimizer state, loss curve) takes the same steps
as one that was never stopped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path


@dataclass(frozen=True)
class Healing:
    steps: int  # end-to-end steps
    lr: float
    objective: str = "kl"  # "kl": the parent's distributions; "text": the next tokens themselves
    transfer_steps: int = 0  # attention-transfer steps first (converted layers alone)
    transfer_lr: float = 1e-3
    save_every: int = 10
    warmup: float = 0.1  # share of each stage's steps over which its learning rate rises from 0
    length: int = 0  # tokens per window (0: the family's)
    chat: bool = False  # windows of the text rendered in the chat template, as users send it


def _trainable(model) -> None:
    """Everything but the token embedding and the output head: they are the parent's, so the
    converted model keeps the parent's vocabulary geometry."""
    model.unfreeze()
    inner = model.model if hasattr(model, "model") else model
    inner.embed_tokens.freeze()
    if isinstance(getattr(model, "lm_head", None), nn.Module):
        model.lm_head.freeze()


def _loss(student, x, target, objective):
    logp = nn.log_softmax(student(x).astype(mx.float32), axis=-1)
    if objective == "text":
        y = x[:, 1:]
        return -mx.take_along_axis(logp[:, :-1], y[..., None], axis=-1).mean()
    return (mx.exp(target) * (target - logp)).sum(-1).mean()


def _save(state_dir: Path, student, optimizer, step: int, curve: list) -> None:
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "trainable.safetensors"),
                        dict(tree_flatten(student.trainable_parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (tmp / "progress.json").write_text(json.dumps({"step": step, "curve": curve}))
    if state_dir.exists():
        for f in state_dir.iterdir():
            f.unlink()
        state_dir.rmdir()
    os.replace(tmp, state_dir)


def _resume(state_dir: Path, student, optimizer) -> tuple[int, list]:
    progress = state_dir / "progress.json"
    if not progress.is_file():
        return 0, []
    student.load_weights(list(mx.load(str(state_dir / "trainable.safetensors")).items()),
                         strict=False)
    saved = mx.load(str(state_dir / "optimizer.safetensors"))
    # into the initialised state's own tree: a flat file loses the frozen layers' empty places
    optimizer.state = tree_map_with_path(lambda path, value: saved.get(path, value),
                                         optimizer.state)
    record = json.loads(progress.read_text())
    return record["step"], record["curve"]


def _mixer(layer):
    """A decoder layer's token mixer: attention or linear attention."""
    return layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn


def _mixer_io(teacher, layers: list[int], x: mx.array) -> dict[int, tuple[mx.array, mx.array]]:
    """The parent's attention input and output at `layers` for tokens x."""
    import contextlib

    from ..capture.instrument import hook_module

    seen: dict[int, list] = {i: [] for i in layers}
    with contextlib.ExitStack() as stack:
        for i in layers:
            stack.enter_context(hook_module(
                teacher.model.layers[i].self_attn,
                before=lambda m, a, k, i=i: seen[i].append(a[0]),
                after=lambda m, a, k, out, i=i: seen[i].append(out)))
        teacher(x)
    return {i: (mx.stop_gradient(v[0]), mx.stop_gradient(v[1])) for i, v in seen.items()}


def _transfer_loss(student, io):
    """Attention transfer (LoLCATs): each converted mixer's output against the parent
    attention's on the parent's own inputs, as a share of that output's energy."""
    from mlx_lm.models.base import create_causal_mask

    total = 0.0
    for i, (x, y) in io.items():
        layer = student.model.layers[i]
        mask = None if getattr(layer, "is_linear", False) else create_causal_mask(x.shape[1])
        out = _mixer(layer)(x, mask, None)
        total = total + ((out - y) ** 2).mean() / (y ** 2).mean()
    return total / len(io)


def _schedule(lr: float, steps: int, warmup: float):
    """Linear warm-up over `warmup` of the steps, then cosine decay to a tenth: the first
    updates of a converted model are its largest otherwise, and they undo what it converted."""
    rise = max(1, round(warmup * steps))
    return optim.join_schedules([optim.linear_schedule(lr / rise, lr, rise),
                                 optim.cosine_decay(lr, max(1, steps - rise), lr / 10)], [rise])


def _train(student, state_dir: Path, steps: int, lr: float, step_loss, save_every: int,
           warmup: float, on_step=None) -> list[dict]:
    """The resumable loop: `step_loss(step)` -> (loss, grads) for the trainable parameters.
    The optimizer's state holds its step, so a resumed run continues the same schedule."""
    optimizer = optim.Adam(learning_rate=_schedule(lr, steps, warmup), bias_correction=True)
    optimizer.init(student.trainable_parameters())
    step, curve = _resume(state_dir, student, optimizer)
    while step < steps:
        started = time.perf_counter()
        loss, grads = step_loss(step)
        optimizer.update(student, grads)
        mx.eval(student.parameters(), optimizer.state, loss)
        step += 1
        curve.append({"step": step, "loss": round(float(loss.item()), 4),
                      "seconds": round(time.perf_counter() - started, 2)})  # this step's
        if step % save_every == 0 or step == steps:
            _save(state_dir, student, optimizer, step, curve)
        if on_step:
            on_step(step, steps, curve[-1])
    return curve


def heal(student, teacher, windows: np.ndarray, healing: Healing, state_dir: Path,
         batch: int = 2, converted: list[int] = (), on_step=None) -> dict[str, list]:
    """Attention transfer of the `converted` layers' mixers (if healing.transfer_steps), then
    end-to-end training of every parameter but the embedding and head, each stage resuming
    from its checkpoint under `state_dir`; returns each stage's loss curve.
    `on_step(stage, step, total, record)` reports progress."""
    batch_of = lambda step: mx.array(windows[step * batch:(step + 1) * batch])  # noqa: E731
    curves = {}
    if healing.transfer_steps and converted:
        student.freeze()
        for i in converted:
            _mixer(student.model.layers[i]).unfreeze()
        transfer_grad = nn.value_and_grad(student, _transfer_loss)
        curves["transfer"] = _train(
            student, state_dir / "transfer", healing.transfer_steps, healing.transfer_lr,
            lambda step: transfer_grad(student, _mixer_io(teacher, list(converted),
                                                          batch_of(step))),
            healing.save_every, healing.warmup,
            on_step and (lambda *a: on_step("transfer", *a)))
    _trainable(student)
    loss_and_grad = nn.value_and_grad(student, _loss)

    def end_to_end(step):
        x = batch_of(healing.transfer_steps + step)
        target = None
        if healing.objective == "kl":
            target = mx.stop_gradient(nn.log_softmax(teacher(x).astype(mx.float32), axis=-1))
        return loss_and_grad(student, x, target, healing.objective)

    curves[healing.objective] = _train(student, state_dir / "end-to-end", healing.steps,
                                       healing.lr, end_to_end, healing.save_every,
                                       healing.warmup, on_step and (lambda *a: on_step(healing.objective, *a)))
    student.freeze()
    return curves
