"""What a cache object is: its kind, shape, rotation, capture points and cost.

Capture points (hybrid-translation paper; JSON and the command line keep its integers 1, 2, 3):
raw, the projection output, pre-norm and un-rotated; normed, post-norm and pre-RoPE (for
recurrent states: the per-token inputs of the recurrence); engine, the tensor the engine caches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum, IntEnum
from typing import Any

import mlx.core as mx
import mlx.nn as nn



class CapturePoint(IntEnum):
    """Where an object is read. JSON and the command line keep the paper's integers."""

    RAW = 1  # the projection output: pre-norm, un-rotated
    NORMED = 2  # post-norm, pre-RoPE; for a recurrent state, the recurrence's per-token inputs
    ENGINE = 3  # the tensor the engine caches


CAPTURE_POINTS = {CapturePoint.RAW: "raw (pre-norm, un-rotated)",
                  CapturePoint.NORMED: "post-norm", CapturePoint.ENGINE: "engine cache"}


class ObjectKind(str, Enum):
    TOKEN_KEY = "token_key"
    TOKEN_VALUE = "token_value"
    MLA_LATENT = "mla_latent"
    ROPE_KEY = "rope_key"
    INDEXER_KEY = "indexer_key"
    CONV_HISTORY = "conv_history"
    RECURRENT_STATE = "recurrent_state"


# mlx-lm's RoPE classes (models/rope_utils.py) and the scaling each one implements.
_ROPE_SCALING = {
    "Llama3RoPE": "llama3",
    "YarnRoPE": "yarn",
    "DynamicNTKScalingRoPE": "dynamic",
    "SuScaledRoPE": "longrope",
    "ProportionalRoPE": "proportional",
}


@dataclass(frozen=True)
class Rotation:
    mode: str  # "none", "full" or "partial" (only the first `dims` features rotate)
    dims: int = 0
    interleaved: bool = False  # mlx `traditional=True`: pairs (0,1), (2,3)... rather than halves
    base: float | None = None
    scaling: str = "none"  # none, linear, llama3, yarn, dynamic, longrope, proportional

    @classmethod
    def of(cls, rope: nn.Module | None, head_dim: int) -> "Rotation":
        """Describe the RoPE module `rope` applied to vectors of `head_dim` features."""
        if rope is None:
            return cls("none")
        dims = int(getattr(rope, "dims", getattr(rope, "dim", head_dim)))
        name = type(rope).__name__
        scaling = _ROPE_SCALING.get(name, "none")
        if name == "RoPE" and getattr(rope, "scale", 1.0) != 1.0:
            scaling = "linear"
        base = getattr(rope, "base", None)
        return cls(
            mode="full" if dims >= head_dim else "partial",
            dims=dims,
            interleaved=bool(getattr(rope, "traditional", False)),
            base=float(base) if base is not None else None,
            scaling=scaling,
        )

    def describe(self) -> str:
        if self.mode == "none":
            return "none"
        words = [self.mode if self.mode == "full" else f"partial {self.dims}"]
        if self.interleaved:
            words.append("interleaved")
        if self.scaling != "none":
            words.append(self.scaling)
        return ", ".join(words)


@dataclass(frozen=True)
class CacheObject:
    """One cached object of one layer, for batch size 1.

    `engine_shape` is the engine tensor, with "T" on the token axis for per-token objects; at raw
    and normed a per-token object is a `(B, T, token_dim)` array.
    """

    name: str  # its slot in the layer: keys, values, latent, rope_key, indexer_key, conv..., state
    kind: ObjectKind
    engine_shape: tuple
    dtype: str
    rotation: Rotation
    capture_points: tuple[int, ...]
    token_dim: int = 0  # features per token at raw and normed; 0 for fixed-size objects
    bytes_per_token: int = 0
    fixed_bytes: int = 0

    def point_for(self, requested: int) -> int:
        """The capture point used when (`requested`) is asked for: the first one at or after it
        (a recurrent state has no raw: asking for raw gives its normed inputs)."""
        for point in sorted(self.capture_points):
            if point >= requested:
                return point
        raise ValueError(f"{self.name} ({self.kind.value}) has no capture point at or after "
                         f"({requested}); it has {self.capture_points}")

    @property
    def per_token(self) -> bool:
        return self.bytes_per_token > 0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        data["engine_shape"] = list(self.engine_shape)
        data["rotation"]["describe"] = self.rotation.describe()
        data["capture_points"] = list(self.capture_points)
        return data


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def activation_dtype(linear: nn.Module) -> mx.Dtype:
    """The dtype a linear layer computes in (its scales' dtype when it is quantized)."""
    return linear["scales"].dtype if "scales" in linear else linear.weight.dtype


def per_token_object(name: str, kind: ObjectKind, engine_shape: tuple, dtype: mx.Dtype,
                     rotation: Rotation, capture_points=tuple(CapturePoint)) -> CacheObject:
    """A per-token object whose engine tensor is `engine_shape` with "T" on the token axis."""
    token_dim = 1
    for size in engine_shape:
        if size != "T":
            token_dim *= size
    return CacheObject(name, kind, engine_shape, dtype_name(dtype), rotation,
                       tuple(capture_points), token_dim=token_dim,
                       bytes_per_token=token_dim * dtype.size)


def fixed_object(name: str, kind: ObjectKind, engine_shape: tuple, dtype: mx.Dtype,
                 capture_points: tuple[int, ...], token_dim: int = 0) -> CacheObject:
    count = 1
    for size in engine_shape:
        count *= size
    return CacheObject(name, kind, engine_shape, dtype_name(dtype), Rotation("none"),
                       capture_points, token_dim=token_dim, fixed_bytes=count * dtype.size)
