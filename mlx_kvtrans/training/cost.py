"""What a plan costs, from the layouts alone (no weights, no prefill): per map the features it
reads and its parameters, per shared feature set its moment matrices, the projected fit time and
memory on this machine, and per switch the translation's FLOPs and bytes.

A layout is derived from `config.json` alone (MLX arrays are lazy: a 48B model's modules
allocate nothing until evaluated), so a user can plan for a checkpoint before downloading it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from ..backend.blas import machine_memory
from ..layouts import CapturePoint, ModelLayout, ObjectKind
from ..layouts.linear_attention import RecurrentInputs
from ..models import input_embedding
from ..translators.features import feature_point
from ..translators.recipes import Recipe, Widths
from ..translators.recipes.base import expanded

FIT_BATCH_TOKENS = 4 * 256  # `kvtrans fit` reads windows in batches of 4 x 256 tokens


def _recurrent_inputs(cache, tokens: int) -> RecurrentInputs:
    """Zero-filled (lazy, shape-only) recurrence inputs of a linear-attention layer."""
    a = (cache.heads_v, cache.dk) if cache.mixer == "kda" else (cache.heads_v,)
    return RecurrentInputs(mx.zeros((1, tokens, cache.heads_k, cache.dk)),
                           mx.zeros((1, tokens, cache.heads_k, cache.dk)),
                           mx.zeros((1, tokens, cache.heads_v, cache.dv)),
                           mx.zeros((1, tokens, *a)), mx.zeros((1, tokens, cache.heads_v)))


def _sample(layer, obj, point, tokens: int = 8):
    """A zero array shaped as `obj` is captured at `point` (never evaluated)."""
    if obj.kind == ObjectKind.RECURRENT_STATE and point == CapturePoint.NORMED:
        return _recurrent_inputs(layer.cache, tokens)
    if point == CapturePoint.ENGINE:
        return mx.zeros(tuple(tokens if d == "T" else d for d in obj.engine_shape))
    return mx.zeros((1, tokens, obj.token_dim))


def feature_width(layout: ModelLayout, layer: int, point: int, kinds=()) -> int:
    """Per-token width of source `layer`'s features at `point` (only objects of `kinds`)."""
    total = 0
    for obj in layout.layers[layer].objects:
        if (kinds and obj.kind.value not in kinds) or feature_point(obj, point) is None:
            continue
        if obj.kind == ObjectKind.RECURRENT_STATE:
            total += sum(math.prod(x.shape[2:])
                         for x in _recurrent_inputs(layout.layers[layer].cache, 1).arrays())
        else:
            total += obj.token_dim
    return total


def layout_widths(source: ModelLayout, target: ModelLayout, recipes: list[Recipe], point: int,
                  identity_width: int = 0, expansion_width: int = 0) -> Widths:
    """The `Widths` that `translator.measure_widths` measures, from the layouts alone."""
    reads = set().union(*(r.feature_reads() for r in recipes))
    features = {(s, kinds): feature_width(source, s, point, kinds) for s, kinds in reads}
    samples = {}
    for layer in target.layers:
        for obj in layer.objects:
            for p in obj.capture_points:
                samples[(layer.index, obj.name, p)] = _sample(layer, obj, p)
            if obj.kind == ObjectKind.RECURRENT_STATE:
                samples[(layer.index, obj.name, CapturePoint.NORMED)] = _sample(
                    layer, obj, CapturePoint.NORMED)
    return Widths(features, identity_width, samples, expansion=expansion_width)


@dataclass
class MapCost:
    layer: int
    name: str
    recipe: str
    sources: tuple[int, ...]
    inputs: int  # features per token, token identity included
    outputs: int
    parameters: int


@dataclass
class FeatureSetCost:
    sources: tuple[int, ...]
    kinds: tuple[str, ...]
    inputs: int
    outputs: int  # every map reading this set, side by side
    maps: int
    moments_bytes: int  # float64 X^T X and X^T Y on the host


@dataclass
class PlanCost:
    maps: list[MapCost]
    feature_sets: list[FeatureSetCost]
    parameters: int
    moments_bytes: int
    fit_peak_bytes: int  # projected: moments + one batch (captures, forward) + both weights
    fit_seconds_per_million_tokens: float  # projected at `gflops`
    solve_seconds: float
    translation_flops_per_token: float
    install_bytes_per_token: int
    gflops: float
    machine_bytes: int
    weights_bytes: int
    lengths: dict = field(default_factory=dict)  # tokens -> {"flops", "bytes", "seconds_at_peak"}

    def to_json(self) -> dict:
        return asdict(self)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weights_bytes(lm) -> int:
    """Bytes of a model's weights as its checkpoint holds them: its safetensors files where
    they are at hand, else from its config: in its `torch_dtype` (a built-but-lazy model's
    arrays are float32 until loaded), and under a `quantization` entry (mlx-lm's, as
    `mlx_lm.convert` writes it) the matrices mlx-lm quantizes at their bits plus a group's
    scale and bias."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    files = sorted(Path(lm.path).glob("*.safetensors")) if lm.path else []
    if files:
        return sum(f.stat().st_size for f in files)
    config = lm.config.get("text_config", lm.config)
    dtype = config.get("torch_dtype", lm.config.get("torch_dtype", "float32"))
    each = DTYPE_BYTES.get(str(dtype), 4)
    quantization = lm.config.get("quantization") or config.get("quantization")
    params = tree_flatten(lm.model.parameters())
    packed = any(not mx.issubdtype(v.dtype, mx.floating) for _, v in params)
    # a config-only model is built unquantized: its matrices count at the quantized size
    group = quantization.get("group_size", 64) if quantization and not packed else 0
    total = 0.0
    for name, v in params:
        if not mx.issubdtype(v.dtype, mx.floating):  # packed quantized weights
            total += v.nbytes
        elif group and name.endswith("weight") and v.ndim >= 2 and v.shape[-1] % group == 0:
            total += v.size * quantized_bits(quantization) / 8
        else:
            total += v.size * each
    return int(total)


def quantized_bits(quantization: dict) -> float:
    """Bits per weight of mlx-lm's quantization: the bits, plus per group a scale and (affine)
    a bias in 16 bits, or (mxfp4 / mxfp8 / nvfp4) an 8-bit scale."""
    bits, group = quantization.get("bits", 4), quantization.get("group_size", 64)
    if quantization.get("mode", "affine") == "affine":
        return bits + 32 / group
    return bits + 8 / group


def parameter_count(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.parameters()))


def active_parameters(lm) -> float:
    """Parameters one token's forward multiplies by: a mixture of experts' expert weights
    count at the routed share (experts per token over experts), the rest whole."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    config = lm.config.get("text_config", lm.config)
    routed = config.get("num_experts_per_tok", config.get("num_experts_per_token"))
    inactive = 0.0
    for _, module in lm.model.named_modules():
        if routed and isinstance(module, (SwitchLinear, QuantizedSwitchLinear)):
            experts = module.weight.shape[0]
            size = sum(v.size for _, v in tree_flatten(module.parameters()))
            inactive += size * (1 - min(routed, experts) / experts)
    return parameter_count(lm.model) - inactive


def forward_bytes_per_token(lm) -> float:
    """Transient bytes per token of one fitting forward (float32), a conservative model measured
    against random models of real per-layer sizes (benchmarks/results/switch.md): the FFN's
    intermediate rows, the logits, a few hidden-wide rows, and for linear-attention layers the
    chunkwise form's per-chunk products (KDA's per-channel decays: heads x chunk x key dim)."""
    from ..layouts.gated_delta import default_chunk_size
    from ..layouts import layout_of
    from ..layouts.linear_attention import DeltaRuleLayer, KimiDeltaAttention

    config = lm.config.get("text_config", lm.config)
    hidden = config.get("hidden_size", 0)
    floats = 4 * config.get("intermediate_size", 4 * hidden) + config.get("vocab_size", 0) \
        + 16 * hidden
    linear = 0.0
    for layer in layout_of(lm.model).layers:
        parts = getattr(layer.cache, "parts", [layer.cache])
        for c in (c for c in parts if isinstance(c, DeltaRuleLayer)):
            per_channel = isinstance(c, KimiDeltaAttention)
            chunk = default_chunk_size(per_channel)
            linear = max(linear, 2 * c.heads_v * chunk * c.dk if per_channel else
                         2 * c.heads_v * (chunk + 2 * c.dk * c.dv / chunk + c.dk + c.dv))
    return 4.0 * (floats + linear)


def plan_cost(source_lm, target_lm, recipes: list[Recipe], point: int,
              identity_width: int = 0, gflops: float = 100.0, bandwidth_gbs: float = 20.0,
              lengths=(1024, 4096), memory_bytes: int | None = None,
              expansion_width: int = 0) -> PlanCost:
    """Project what fitting and using `recipes` costs (`source_lm`, `target_lm`: LoadedModels,
    weights or not). `gflops` / `bandwidth_gbs` / `memory_bytes`: the machine's matmul rate,
    bandwidth and memory (default memory: this machine's)."""
    from ..layouts import layout_of

    source_model, target_model = source_lm.model, target_lm.model
    source, target = layout_of(source_model), layout_of(target_model)
    widths = layout_widths(source, target, recipes, point, identity_width, expansion_width)
    widths.vocab = input_embedding(target_model).weight.shape[0]
    maps, sets = [], {}
    params = translation = tables = 0.0
    for r in recipes:
        r = r.shaped(widths)
        shapes = r.param_shapes(widths)
        if not shapes:
            continue
        n = sum(math.prod(s) for s in shapes.values())
        outputs = sum(s[0] for name, s in shapes.items() if name.endswith("weight"))
        inputs = next((s[1] for name, s in shapes.items() if name.endswith("weight")), 0)
        maps.append(MapCost(r.layer, r.name, r.recipe, r.sources, inputs, outputs, n))
        if getattr(r, "tables", 0):  # per-id sums of x and y, two lags, float64
            tables += 16.0 * widths.vocab * (inputs + outputs)
        params += n
        obj = target.layers[r.layer].cache.object(r.name)
        translation += r.flops(1, shapes, obj)
        if hasattr(r, "feature_key"):
            key = r.feature_key()
            entry = sets.setdefault(key, [inputs, 0, 0])
            entry[1] += outputs
            entry[2] += 1
    feature_sets = [FeatureSetCost(k[0], k[1], d, o, m, 8 * d * (d + o))
                    for k, (d, o, m) in sets.items()]
    if expansion_width:  # random features: each feature set's projection
        from ..translators.random_features import RandomFeatures

        translation += sum(map(RandomFeatures(expansion_width).flops,
                               (d for k, (d, _, _) in sets.items() if expanded(k))))
    moments = sum(f.moments_bytes for f in feature_sets) + tables
    accumulate_flops = sum(2.0 * f.inputs * (f.inputs + f.outputs) for f in feature_sets)
    prefill_flops = 2.0 * (active_parameters(source_lm) + active_parameters(target_lm))
    per_token = accumulate_flops + prefill_flops
    batch_device = sum(4 * f.inputs * (f.inputs + f.outputs) + 4 * FIT_BATCH_TOKENS
                       * (f.inputs + f.outputs) for f in feature_sets)
    # one batch's captures (both models, every object at two points) and the larger forward
    captured = sum(o.bytes_per_token for layout in (source, target) for l in layout.layers
                   for o in l.objects)
    batch_device += FIT_BATCH_TOKENS * (2 * captured + max(forward_bytes_per_token(source_lm),
                                                           forward_bytes_per_token(target_lm)))
    weights = weights_bytes(source_lm) + weights_bytes(target_lm)
    solve_flops = sum(f.inputs ** 3 / 3 + 2.0 * f.inputs ** 2 * f.outputs for f in feature_sets)
    install = sum(o.bytes_per_token for l in target.layers for o in l.objects)
    fixed = sum(o.fixed_bytes for l in target.layers for o in l.objects)
    cost = PlanCost(maps, feature_sets, int(params), int(moments),
                    int(moments + batch_device + weights),
                    1e6 * per_token / (gflops * 1e9), solve_flops / (gflops * 1e9),
                    translation, install, gflops, memory_bytes or machine_memory(), weights)
    for n in lengths:
        flops, nbytes = translation * n, install * n + fixed
        cost.lengths[n] = {"flops": flops, "bytes": nbytes,
                           "seconds_at_peak": flops / (gflops * 1e9)
                           + nbytes / (bandwidth_gbs * 1e9)}
    return cost


def fits(cost: PlanCost, share: float = 0.9) -> bool:
    """Whether the projected fit fits in `share` of this machine's memory."""
    return cost.fit_peak_bytes <= share * cost.machine_bytes


ALTERNATIVES = ({"features": "nearest", "nu": 2}, {"features": "nearest", "nu": 1},
                {"features": "nearest", "nu": 1, "token_identity": "off"})


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def format_duration(seconds: float) -> str:
    """A duration as a person reads it: 45 s, 12 min, 3.5 h, 12 days, 3 years."""
    for unit, size, limit in (("s", 1, 90), ("min", 60, 90 * 60), ("h", 3600, 48 * 3600),
                              ("days", 86400, 2 * 365 * 86400)):
        if seconds < limit:
            value = seconds / size
            return f"{value:.0f} {unit}" if value >= 10 or unit == "s" else f"{value:.1f} {unit}"
    return f"{seconds / (365 * 86400):,.0f} years"

