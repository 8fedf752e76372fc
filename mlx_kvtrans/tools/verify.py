"""`kvtrans verify`: prove on a checkpoint that capture, conversion, install and replay are exact.

Run it when a new checkpoint or mlx-lm version appears: every translator stands on these
identities holding for the model at hand.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from ..capture import capture
from ..translators.install import install, to_engine
from ..layouts import CapturePoint, ModelLayout, ObjectKind, layout_of
from ..layouts.linear_attention import RecurrentInputs
from ..prompt_cache import read_prompt_cache, write_prompt_cache

SAMPLE_TEXT = (
    "The keeper of the lighthouse wrote every evening in a small green book: the wind, the "
    "ships that passed, the colour of the sea. On the third of March she noted a code, 418207, "
    "and underlined it twice. Nobody asked her why. "
)
CONTINUATION = 8  # tokens every check continues with after the prompt

# A correct install continues like the engine's own cache, and that continuation differs from
# the full forward by what reading a prompt in two pieces differs by anyway (float32 sums
# reassociate). The tolerance against the full forward is that error times this factor, so a
# correct model passes on any seed while a wrong install (errors near the logits' scale) fails.
REASSOCIATION_SAFETY = 4.0


@dataclass
class Check:
    name: str
    passed: bool
    max_abs_diff: float
    tolerance: float
    detail: str = ""


def max_abs_diff(a: mx.array, b: mx.array) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))))


def _tolerance(dtype: mx.Dtype, scale: float) -> float:
    """Float32 agrees to 1e-5; half precision to a few ulps of the largest value compared."""
    rel = 1e-5 if dtype == mx.float32 else 2e-2
    return rel * max(1.0, scale)


def _scale(x: mx.array) -> float:
    return float(mx.max(mx.abs(x.astype(mx.float32))))


def verification_tokens(tokenizer, layout: ModelLayout, prefix: int | None,
                        continuation: int = CONTINUATION) -> list[int]:
    """A prompt long enough to exercise every object (the indexer selects only beyond top-k)."""
    top_k = max((part.top_k for layer in layout.layers
                 for part in getattr(layer.cache, "parts", []) if hasattr(part, "top_k")),
                default=0)
    prefix = prefix or max(64, top_k + 16)
    ids = tokenizer.encode(SAMPLE_TEXT)
    while len(ids) < prefix + continuation:
        ids = ids + ids
    return ids[: prefix + continuation]


def two_piece_forward(model, head: mx.array, tail: mx.array) -> mx.array:
    """The logits of `tail` after the model read `head` into mlx-lm's own cache (no capture)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(head, cache=cache)
    return model(tail, cache=cache)


def _check(dtype: mx.Dtype, name: str, diff: float, scale: float, detail: str = "",
           floor: float = 0.0) -> Check:
    """A check that `diff` is within the dtype's tolerance at `scale` (or `floor`, where a
    larger error is expected of a correct model)."""
    tol = max(_tolerance(dtype, scale), floor)
    return Check(name, bool(diff <= tol), diff, tol, detail)


def _conversion_checks(layout: ModelLayout, cap, dtype: mx.Dtype) -> list[Check]:
    """Per object kind, that converting what capture points 1 and 2 recorded gives the
    engine's own cache (point 3): a translator may map at any point. Recurrent state is
    checked by replay instead."""
    checks = []
    for point in (1, 2):
        converted = to_engine(layout, cap.at(point), point)
        for kind in sorted(layout.kinds(), key=lambda k: k.value):
            if kind == ObjectKind.RECURRENT_STATE:
                continue  # checked as replay
            diffs, scale = [0.0], 0.0
            for layer, conv, native in zip(layout.layers, converted, cap.at(3)):
                for obj in layer.objects:
                    if obj.kind == kind and obj.point_for(point) == point:
                        diffs.append(max_abs_diff(conv[obj.name], native[obj.name]))
                        scale = max(scale, _scale(native[obj.name]))
            if len(diffs) > 1:  # the kind has this capture point
                checks.append(_check(
                    dtype, f"{CapturePoint(point).name.lower()} -> engine conversion equals "
                    f"the engine cache: {kind.value}", max(diffs), scale))
    return checks


def _replay_checks(layout: ModelLayout, cap, prefix: int, dtype: mx.Dtype) -> list[Check]:
    """That the recurrent layers' captured inputs rebuild their state, whole and in chunks,
    and that the rows before the short convolution rebuild those inputs: what a translator
    of linear attention maps is enough to install."""
    whole = [0.0]
    chunked = [0.0]
    convolved = [0.0]
    scale = 0.0
    input_scale = 0.0
    chunk = max(1, prefix // 3 + 1)
    for layer, raw, objects, native in zip(layout.layers, cap.at(1), cap.at(2), cap.at(3)):
        inputs = objects.get("state")
        if not isinstance(inputs, RecurrentInputs):
            continue
        _, state = layer.cache.replay(inputs)
        _, state_chunked = layer.cache.replay(inputs, chunk_size=chunk)
        whole.append(max_abs_diff(state, native["state"]))
        chunked.append(max_abs_diff(state_chunked, native["state"]))
        scale = max(scale, _scale(native["state"]))
        made = layer.cache.convolved(layer.cache.raw_inputs(
            {name: raw[name] for name in layer.cache.conv_names}, inputs), {})
        convolved.append(max(max_abs_diff(made.k, inputs.k), max_abs_diff(made.v, inputs.v)))
        input_scale = max(input_scale, _scale(inputs.k), _scale(inputs.v))
    return [
        _check(dtype, "replay of captured normed inputs reproduces the recurrent state",
               max(whole), scale),
        _check(dtype, "the rows before the short convolution, convolved, are the normed inputs",
               max(convolved), input_scale),
        _check(dtype, "replay in chunks reproduces the recurrent state", max(chunked), scale,
               f"chunks of {chunk} tokens")]


def _prompt_cache_check(model, layout: ModelLayout, cap, tail: mx.array,
                        from_installed: mx.array, model_name: str, dtype: mx.Dtype) -> Check:
    """That an installed cache written as a prompt-cache file, read back by mlx-lm and by us,
    continues like the installed cache itself: the file is how a translated cache leaves."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompt_cache.safetensors"
        write_prompt_cache(path, install(layout, cap.at(3)), model_name)
        from mlx_lm.models.cache import load_prompt_cache

        reloaded = model(tail, cache=load_prompt_cache(str(path)))
        objects, _ = read_prompt_cache(path, layout)
        read_back = model(tail, cache=install(layout, objects))
        return _check(
            dtype, "prompt-cache file written, read back by mlx-lm, continues the same",
            max(max_abs_diff(reloaded, from_installed), max_abs_diff(read_back, from_installed)),
            _scale(from_installed))


def run_checks(model, tokenizer, prefix: int | None = None, continuation: int = CONTINUATION,
               model_name: str = "model") -> list[Check]:
    """Every identity a translator stands on, checked on `model`: a capture installs as the
    engine's cache, converts between capture points, replays, and survives a prompt-cache
    file."""
    layout = layout_of(model)
    dtype = getattr(mx, layout.layers[0].cache.objects[0].dtype)
    ids = verification_tokens(tokenizer, layout, prefix, continuation)
    prefix = len(ids) - continuation
    tokens = mx.array([ids])
    head, tail = tokens[:, :prefix], tokens[:, prefix:]

    full = model(tokens)[:, prefix:]
    reassociation = max_abs_diff(two_piece_forward(model, head, tail), full)
    cap = capture(model, head)
    from_engine = model(tail, cache=cap.engine)
    from_installed = model(tail, cache=install(layout, cap.at(3)))
    checks = [
        _check(dtype, "capture(3) -> install continues like the engine's own cache",
               max_abs_diff(from_installed, from_engine), _scale(from_engine),
               f"{continuation} continuation tokens after {prefix}"),
        _check(dtype, "capture(3) -> install continues like the full forward",
               max_abs_diff(from_installed, full), _scale(full),
               f"the prompt read in two pieces differs by {reassociation:.1e}",
               floor=REASSOCIATION_SAFETY * reassociation)]
    checks += _conversion_checks(layout, cap, dtype)
    if ObjectKind.RECURRENT_STATE in layout.kinds():
        checks += _replay_checks(layout, cap, prefix, dtype)
    checks.append(_prompt_cache_check(model, layout, cap, tail, from_installed, model_name,
                                      dtype))
    return checks


def checks_to_json(checks: list[Check]) -> dict:
    return {"checks": [asdict(c) for c in checks], "passed": all(c.passed for c in checks)}
