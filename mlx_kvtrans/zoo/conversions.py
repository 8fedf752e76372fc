"""Convert a llama GQA checkpoint into other cache families, as mlx-lm checkpoints of their own
`model_type`: the real family's members before healing (`zoo/healing.py`).

Each function takes the parent (an mlx-lm `llama.Model`) and calibration statistics
(`Calibration`, from a few windows of text) and returns (config, weights) for the new model.
The conversions are exact where the target architecture can express the parent and say so where
it cannot:

- MLA (`deepseek_v3`, TransMLA's RoRoPE): per rotary frequency, the 3 KV groups' key pairs are
  mixed by an orthogonal 3x3 matrix that orders their energy (mixing groups commutes with RoPE,
  which rotates each pair by the same angle in every group). The leading components become the
  decoupled rope key, each pair rotating at its own frequency (mlx-lm's `longrope` with per-pair
  factors); the last loses its rotation and joins the values in the latent (deepseek_v3 needs a
  latent key part). `kv_a_layernorm` is made a constant scale by one latent channel of large
  constant bias, so the latent's norm hardly varies. What is lost: the last component's rotation.
- Gated DeltaNet hybrid (`qwen3_next`): odd layers keep full attention, exactly (head_dim 128 with
  partial RoPE over the parent's 64 dims; one constant channel per head, from the bias, makes
  `q_norm` / `k_norm` a near-constant scale; the output gate's bias saturates the sigmoid). Even
  layers become Gated DeltaNet initialised from the attention projections (Mamba-in-the-Llama,
  LoLCATs): q, k, v, out from Q, K, V, O, an identity short convolution, decays near 1.
- KDA + MLA hybrid (`kimi_linear`): the layers where attending without RoPE costs least
  (`nope_costs`) are the MLA conversion's layers without RoPE (Kimi-Linear's MLA has none), the
  rest Kimi Delta Attention initialised the same way, so the pair (MLA conversion, KDA hybrid)
  has the shape of Kimi-VL <-> Kimi-Linear.
- MLA + sparse-attention indexer (`deepseek_v32`): the MLA conversion with an indexer that scores
  keys by the attention's own rope queries and key; exact up to `index_topk` keys.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..capture.instrument import hook_module

NORM_CHANNEL_SCALE = 64.0  # the constant channel's bias, in multiples of the largest norm seen
GATE_BIAS = 20.0  # sigmoid(20) = 1 - 2e-9: an output gate that passes everything
DECAYS = (0.9, 0.999)  # per-head state decays of a converted linear-attention layer at start


@dataclass
class Calibration:
    """Per layer of the parent, over a few windows of text (float64 numpy):
    `inputs`: the attention's input (after input_layernorm), (N, hidden);
    `outputs`: the attention's per-head output before o_proj, (N, heads * head_dim)."""
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]


def calibrate(parent, windows: np.ndarray) -> Calibration:
    layers = parent.model.layers
    inputs = [[] for _ in layers]
    outputs = [[] for _ in layers]
    with contextlib.ExitStack() as stack:
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            stack.enter_context(hook_module(
                attn, before=lambda m, a, k, i=i: inputs[i].append(a[0])))
            stack.enter_context(hook_module(
                attn.o_proj, before=lambda m, a, k, i=i: outputs[i].append(a[0])))
        for window in windows:
            parent(mx.array(window[None]))
            mx.eval(inputs, outputs)
    flat = lambda parts: np.concatenate(  # noqa: E731
        [np.asarray(p.astype(mx.float32)).reshape(-1, p.shape[-1]) for p in parts]).astype(np.float64)
    return Calibration([flat(p) for p in inputs], [flat(p) for p in outputs])


def _np(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32)).astype(np.float64)


def _mx(a: np.ndarray) -> mx.array:
    return mx.array(np.ascontiguousarray(a).astype(np.float32))


def _shared(parent) -> dict[str, mx.array]:
    """Embedding, final norm and every layer's MLP and norms: unchanged in every member."""
    weights = {}
    for name, value in _flat_parameters(parent).items():
        if ".self_attn." not in name:
            weights[name] = value
    return weights


def _flat_parameters(model) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten
    return dict(tree_flatten(model.parameters()))


@dataclass(frozen=True)
class Geometry:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    theta: float

    @classmethod
    def of(cls, config: dict) -> "Geometry":
        return cls(config["hidden_size"], config["num_attention_heads"],
                   config["num_key_value_heads"], config["head_dim"], config["rope_theta"])

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _attention(parent, layer: int, g: Geometry):
    """The parent layer's projections as numpy: Q (heads, hd, hidden), K and V (kv, hd, hidden),
    O (hidden, heads, hd). Q and K keep llama.cpp's interleaved pair order (rope_traditional)."""
    attn = parent.model.layers[layer].self_attn
    q = _np(attn.q_proj.weight).reshape(g.heads, g.head_dim, g.hidden)
    k = _np(attn.k_proj.weight).reshape(g.kv_heads, g.head_dim, g.hidden)
    v = _np(attn.v_proj.weight).reshape(g.kv_heads, g.head_dim, g.hidden)
    o = _np(attn.o_proj.weight).reshape(g.hidden, g.heads, g.head_dim)
    return q, k, v, o


# --- MLA -----------------------------------------------------------------------------------------

@dataclass
class MlaLayer:
    """One converted layer: q (heads, nope + rope, hidden) with the score scale folded in;
    latent rows (rank, hidden) [minor key components; values]; rope key rows (rope, hidden) in
    half-split pair order (pair p at rows p and p + rope / 2) with each pair's wavelength;
    per-head key and value reads of the latent."""
    q: np.ndarray
    latent: np.ndarray
    rope_key: np.ndarray
    wavelengths: np.ndarray  # (rope / 2,): the parent's wavelength of each rope-key pair
    embed_q: np.ndarray  # (heads, rank, nope): k_nope_h = latent @ embed_q[h]
    unembed_out: np.ndarray  # (heads, v_dim, rank): v_h = latent @ unembed_out[h].T
    o: np.ndarray  # (hidden, heads * v_dim)
    kept_energy: float  # share of the keys' energy that keeps its rotation


def mla_layer(parent, layer: int, g: Geometry, x: np.ndarray, components: int) -> MlaLayer:
    """RoRoPE: per frequency pair j, the orthogonal mix U_j of the KV groups' key pairs whose
    first `components` components carry the most energy on the calibration inputs `x`; they
    keep their rotation (the rope key, `components` x head_dim wide), the rest join the latent."""
    q, k, v, o = _attention(parent, layer, g)
    pairs = g.head_dim // 2
    nope = (g.kv_heads - components) * g.head_dim
    rope = components * g.head_dim
    q_new = np.zeros((g.heads, nope + rope, g.hidden))
    minor = np.zeros((nope, g.hidden))
    rope_key = np.zeros((rope, g.hidden))
    wavelengths = np.zeros(rope // 2)
    kept = total = 0.0
    for j in range(pairs):
        rows = slice(2 * j, 2 * j + 2)
        keys = np.stack([x @ k[grp, rows].T for grp in range(g.kv_heads)])  # (kv, N, 2)
        energy = np.einsum("gnc,hnc->gh", keys, keys)
        eigenvalues, vectors = np.linalg.eigh(energy)
        mix = vectors[:, ::-1].T  # rows: components by falling energy; U @ U.T = I
        kept += eigenvalues[::-1][:components].sum()
        total += eigenvalues.sum()
        mixed = np.einsum("mg,gcd->mcd", mix, k[:, rows])  # (kv, 2, hidden)
        for m in range(g.kv_heads):
            if m < components:
                pair = m * pairs + j
                at = [nope + pair, nope + pair + rope // 2]
                rope_key[[pair, pair + rope // 2]] = mixed[m]
                wavelengths[pair] = g.theta ** (2 * j / g.head_dim)
            else:
                start = (m - components) * g.head_dim + 2 * j
                at = [start, start + 1]
                minor[start:start + 2] = mixed[m]
            for h in range(g.heads):
                q_new[h, at] = mix[m, h // g.group] * q[h, rows]
    q_new *= np.sqrt((nope + rope) / g.head_dim)  # MLA scales scores by (nope+rope)^-1/2
    latent = np.concatenate([minor, v.reshape(-1, g.hidden)])
    rank = len(latent)
    embed_q = np.zeros((g.heads, rank, nope))
    embed_q[:, np.arange(nope), np.arange(nope)] = 1.0
    unembed_out = np.zeros((g.heads, g.head_dim, rank))
    for h in range(g.heads):
        start = nope + (h // g.group) * g.head_dim
        unembed_out[h, np.arange(g.head_dim), start + np.arange(g.head_dim)] = 1.0
    return MlaLayer(q_new, latent, rope_key, wavelengths, embed_q, unembed_out,
                    o.reshape(g.hidden, -1), float(kept / total))


def rope_scaling(wavelengths: np.ndarray, theta: float, max_positions: int) -> dict:
    """mlx-lm's `longrope` (SuScaledRoPE, half-split pairs) with each pair's own wavelength:
    its factor divides out the default wavelength theta^(2p / dims) of pair p; equal maximum and
    original positions make its magnitude scale 1."""
    dims = 2 * len(wavelengths)
    factors = [float(w / theta ** (2 * p / dims)) for p, w in enumerate(wavelengths)]
    return {"rope_type": "longrope", "original_max_position_embeddings": max_positions,
            "short_factor": factors, "long_factor": factors}


def _norm_channel(latent: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    """(bias of the constant channel, the RMSNorm weight that undoes the normalisation) for a
    latent of rows `latent` read on inputs `x`."""
    norms = np.linalg.norm(x @ latent.T, axis=1)
    constant = NORM_CHANNEL_SCALE * float(norms.max())
    rank = len(latent) + 1
    scale = float(np.sqrt((np.mean(norms ** 2) + constant ** 2) / rank))
    return constant, scale


def to_mla(parent, config: dict, calibration: Calibration, components: int = 2
           ) -> tuple[dict, dict, dict]:
    """deepseek_v3 config and weights, and a report of what each layer kept. `components`: how
    many of each frequency's KV-group components keep their rotation (`mla_layer`)."""
    g = Geometry.of(config)
    weights = _shared(parent)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # deepseek_v3 ties nothing
    kept = []
    for i in range(config["num_hidden_layers"]):
        layer = mla_layer(parent, i, g, calibration.inputs[i], components)
        constant, scale = _norm_channel(layer.latent, calibration.inputs[i])
        rank = len(layer.latent) + 1
        p = f"model.layers.{i}.self_attn."
        weights[p + "q_proj.weight"] = _mx(layer.q.reshape(-1, g.hidden))
        rows = np.concatenate([layer.latent, np.zeros((1, g.hidden)), layer.rope_key])
        bias = np.zeros(len(rows))
        bias[len(layer.latent)] = constant
        weights[p + "kv_a_proj_with_mqa.weight"] = _mx(rows)
        weights[p + "kv_a_proj_with_mqa.bias"] = _mx(bias)
        norm = np.full(rank, scale)
        norm[-1] = 1.0 / np.sqrt(rank)  # the constant channel reads about 1 after the norm
        weights[p + "kv_a_layernorm.weight"] = _mx(norm)
        weights[p + "embed_q.weight"] = _mx(np.pad(layer.embed_q, ((0, 0), (0, 1), (0, 0))))
        weights[p + "unembed_out.weight"] = _mx(np.pad(layer.unembed_out, ((0, 0), (0, 0), (0, 1))))
        weights[p + "o_proj.weight"] = _mx(layer.o)
        weights[p + "o_proj.bias"] = mx.zeros(g.hidden)
        kept.append(round(layer.kept_energy, 4))
    nope = (g.kv_heads - components) * g.head_dim
    rope = components * g.head_dim
    new = {"model_type": "deepseek_v3", "vocab_size": config["vocab_size"],
           "hidden_size": g.hidden, "intermediate_size": config["intermediate_size"],
           "moe_intermediate_size": config["intermediate_size"],
           "num_hidden_layers": config["num_hidden_layers"],
           "num_attention_heads": g.heads, "num_key_value_heads": g.heads,
           "first_k_dense_replace": config["num_hidden_layers"],  # dense: no experts
           "kv_lora_rank": nope + g.kv_heads * g.head_dim + 1, "q_lora_rank": None,
           "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": g.head_dim,
           "rms_norm_eps": config["rms_norm_eps"], "rope_theta": g.theta,
           "rope_scaling": rope_scaling(layer.wavelengths, g.theta,
                                        config["max_position_embeddings"]),
           "max_position_embeddings": config["max_position_embeddings"],
           "attention_bias": True, "tie_word_embeddings": False}
    return new, weights, {"rope_components": components, "rope_energy_kept": kept,
                         "converted": list(range(config["num_hidden_layers"]))}


# --- linear attention initialised from attention ----------------------------------------------

def _decay_logits(count: int) -> np.ndarray:
    """dt_bias giving per-head decays exp(-softplus(dt)) spread over DECAYS (A_log = 0)."""
    decays = np.geomspace(1 - DECAYS[0], 1 - DECAYS[1], count)  # 1 - decay
    rates = -np.log(1 - decays)  # softplus(dt) = -log(decay)
    return np.log(np.expm1(rates))


def _expanded(k: np.ndarray, g: Geometry) -> np.ndarray:
    """(kv, hd, hidden) -> (heads, hd, hidden): each query head's own copy of its group's rows."""
    return np.repeat(k, g.group, axis=0)


def _head_rms(outputs: np.ndarray, g: Geometry) -> np.ndarray:
    per_head = outputs.reshape(len(outputs), g.heads, g.head_dim)
    return np.sqrt((per_head ** 2).mean(axis=(0, 2)))


def _unit_gate(x: np.ndarray, target: float) -> np.ndarray:
    """A row w with w @ x about `target` on the calibration inputs (along their mean)."""
    mean = x.mean(axis=0)
    return target * mean / float(mean @ mean)


def gated_deltanet_layer(parent, layer: int, g: Geometry, cal: Calibration,
                         kernel: int) -> dict[str, np.ndarray]:
    """Qwen3-Next Gated DeltaNet weights (9 key and value heads of the parent's head_dim)."""
    q, k, v, o = _attention(parent, layer, g)
    k, v = _expanded(k, g), _expanded(v, g)
    # the output is silu(z) * RMSNorm(out): z about 1.28 (silu = 1), norm weight the head's rms
    z = np.tile(_unit_gate(cal.inputs[layer], 1.2785), (g.head_dim, 1))
    qkvz = np.concatenate([np.concatenate([q[h], k[h], v[h], z]) for h in range(g.heads)])
    conv = np.zeros((3 * g.heads * g.head_dim, kernel, 1))
    conv[:, -1, 0] = 1.0
    return {"in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": np.zeros((2 * g.heads, g.hidden)),
            "conv1d.weight": conv, "dt_bias": _decay_logits(g.heads), "A_log": np.zeros(g.heads),
            "norm.weight": np.full(g.head_dim, _head_rms(cal.outputs[layer], g).mean()),
            "out_proj.weight": o.reshape(g.hidden, -1)}


def full_attention_layer(parent, layer: int, g: Geometry, cal: Calibration) -> dict[str, np.ndarray]:
    """Qwen3-Next attention that computes the parent's: head_dim 2 x the parent's, the first half
    rotated (partial RoPE), one constant channel per head that makes q_norm / k_norm a near-constant
    scale, and a saturated output gate."""
    q, k, v, o = _attention(parent, layer, g)
    hd = g.head_dim
    half = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])  # interleaved -> split pairs
    q, k = q[:, half], k[:, half]
    x = cal.inputs[layer]
    q_const = NORM_CHANNEL_SCALE * float(np.linalg.norm(np.einsum("hdn,tn->thd", q, x), axis=-1).max())
    k_const = NORM_CHANNEL_SCALE * float(np.linalg.norm(np.einsum("hdn,tn->thd", k, x), axis=-1).max())
    q_rows = np.zeros((g.heads, 2, 2 * hd, g.hidden))  # (head, query | gate, dim, hidden)
    q_rows[:, 0, :hd] = q
    q_bias = np.zeros((g.heads, 2, 2 * hd))
    q_bias[:, 0, hd] = q_const
    q_bias[:, 1, :] = GATE_BIAS
    k_rows = np.zeros((g.kv_heads, 2 * hd, g.hidden))
    k_rows[:, :hd] = k
    k_bias = np.zeros((g.kv_heads, 2 * hd))
    k_bias[:, hd + 1] = k_const
    v_rows = np.zeros((g.kv_heads, 2 * hd, g.hidden))
    v_rows[:, :hd] = v
    o_cols = np.zeros((g.hidden, g.heads, 2 * hd))
    o_cols[:, :, :hd] = o
    # RMSNorm over 2*hd dims of [q; C] is about C / sqrt(2 hd): the weight undoes it, and the
    # extra sqrt(2) undoes the score scale (2 hd)^-1/2 in place of hd^-1/2
    def norm(const, rows):
        mean_sq = np.mean(np.sum(np.einsum("hdn,tn->thd", rows[:, :hd], x) ** 2, -1))
        w = np.ones(2 * hd)
        w[:hd] = np.sqrt((mean_sq + const ** 2) / (2 * hd))
        return w
    q_norm = norm(q_const, q_rows[:, 0]) * np.r_[np.full(hd, np.sqrt(2.0)), np.ones(hd)]
    return {"q_proj.weight": q_rows.reshape(-1, g.hidden), "q_proj.bias": q_bias.reshape(-1),
            "k_proj.weight": k_rows.reshape(-1, g.hidden), "k_proj.bias": k_bias.reshape(-1),
            "v_proj.weight": v_rows.reshape(-1, g.hidden), "v_proj.bias": np.zeros(g.kv_heads * 2 * hd),
            "o_proj.weight": o_cols.reshape(g.hidden, -1), "o_proj.bias": np.zeros(g.hidden),
            "q_norm.weight": q_norm, "k_norm.weight": norm(k_const, k_rows)}


def to_gated_deltanet(parent, config: dict, calibration: Calibration,
                      kernel: int = 4) -> tuple[dict, dict, dict]:
    """qwen3_next config and weights: layers with (i + 1) % 2 != 0 Gated DeltaNet, the rest full
    attention."""
    g = Geometry.of(config)
    weights = _shared(parent)
    linear = []
    for i in range(config["num_hidden_layers"]):
        if (i + 1) % 2 != 0:
            linear.append(i)
            parts, prefix = gated_deltanet_layer(parent, i, g, calibration, kernel), "linear_attn."
        else:
            parts, prefix = full_attention_layer(parent, i, g, calibration), "self_attn."
        for name, value in parts.items():
            weights[f"model.layers.{i}.{prefix}{name}"] = _mx(value)
    new = {"model_type": "qwen3_next", "vocab_size": config["vocab_size"],
           "hidden_size": g.hidden, "intermediate_size": config["intermediate_size"],
           "num_hidden_layers": config["num_hidden_layers"], "num_attention_heads": g.heads,
           "num_key_value_heads": g.kv_heads, "head_dim": 2 * g.head_dim,
           "partial_rotary_factor": 0.5, "rope_theta": g.theta, "attention_bias": True,
           "linear_num_value_heads": g.heads, "linear_num_key_heads": g.heads,
           "linear_key_head_dim": g.head_dim, "linear_value_head_dim": g.head_dim,
           "linear_conv_kernel_dim": kernel, "full_attention_interval": 2,
           "num_experts": 0, "num_experts_per_tok": 0, "decoder_sparse_step": 1,
           "shared_expert_intermediate_size": 0, "moe_intermediate_size": 0,
           "mlp_only_layers": [], "rms_norm_eps": config["rms_norm_eps"],
           "max_position_embeddings": config["max_position_embeddings"],
           "tie_word_embeddings": config.get("tie_word_embeddings", True)}
    return new, weights, {"linear_layers": linear, "converted": linear}


def kda_layer(parent, layer: int, g: Geometry, cal: Calibration) -> dict[str, np.ndarray]:
    """Kimi Delta Attention weights (the parent's heads): q, k, v, o from Q, K, V, O, identity
    short convolutions, channel decays near 1, the output gate sigmoid(0) = 1/2 with the norm
    weight doubled to match."""
    q, k, v, o = _attention(parent, layer, g)
    width = g.heads * g.head_dim
    kernel = 4
    conv = np.zeros((width, kernel, 1))
    conv[:, -1, 0] = 1.0
    dt = np.repeat(_decay_logits(g.heads), g.head_dim)
    return {"q_proj.weight": q.reshape(width, -1), "k_proj.weight": _expanded(k, g).reshape(width, -1),
            "v_proj.weight": _expanded(v, g).reshape(width, -1),
            "q_conv.conv.weight": conv, "k_conv.conv.weight": conv, "v_conv.conv.weight": conv,
            "f_a_proj.weight": np.zeros((g.head_dim, g.hidden)),
            "f_b_proj.weight": np.zeros((width, g.head_dim)),
            "b_proj.weight": np.zeros((g.heads, g.hidden)),
            "g_a_proj.weight": np.zeros((g.head_dim, g.hidden)),
            "g_b_proj.weight": np.zeros((width, g.head_dim)),
            "A_log": np.zeros((1, 1, g.heads, 1)), "dt_bias": dt,
            "o_norm.weight": np.full(g.head_dim, 2 * _head_rms(cal.outputs[layer], g).mean()),
            "o_proj.weight": o.reshape(g.hidden, -1)}


def nope_costs(parent, windows: np.ndarray) -> list[float]:
    """Per layer of the parent, the KL (nats/token) its next-token distributions move by when that
    layer alone attends without RoPE: what Kimi-Linear's position-free MLA costs there."""
    import mlx.nn as nn

    def log_probs():
        return [nn.log_softmax(parent(mx.array(w[None])).astype(mx.float32), axis=-1)
                for w in windows]

    native = log_probs()
    mx.eval(native)
    costs = []
    for layer in parent.model.layers:
        rope = layer.self_attn.rope
        layer.self_attn.rope = lambda x, offset=0: x
        try:
            costs.append(float(np.mean([(mx.exp(a) * (a - b)).sum(-1).mean().item()
                                        for a, b in zip(native, log_probs())])))
        finally:
            layer.self_attn.rope = rope
    return costs


def to_kda(parent, config: dict, calibration: Calibration, components: int = 2,
           attention_layers: list[int] | None = None) -> tuple[dict, dict, dict]:
    """kimi_linear config and weights: `attention_layers` (0-based; default the odd ones) are the
    MLA conversion's layers without RoPE or the constant channel (kimi_linear's MLA has no bias),
    the rest Kimi Delta Attention initialised from the parent's heads."""
    g = Geometry.of(config)
    weights = _shared(parent)
    layers = config["num_hidden_layers"]
    attention = set(range(1, layers, 2) if attention_layers is None else attention_layers)
    kda = []
    for i in range(layers):
        p = f"model.layers.{i}."
        if i not in attention:
            kda.append(i + 1)
            for name, value in kda_layer(parent, i, g, calibration).items():
                weights[p + "self_attn." + name] = _mx(value)
            continue
        layer = mla_layer(parent, i, g, calibration.inputs[i], components)
        norms = np.linalg.norm(calibration.inputs[i] @ layer.latent.T, axis=1)
        scale = float(np.sqrt(np.mean(norms ** 2) / len(layer.latent)))
        weights[p + "self_attn.q_proj.weight"] = _mx(layer.q.reshape(-1, g.hidden))
        weights[p + "self_attn.kv_a_proj_with_mqa.weight"] = _mx(
            np.concatenate([layer.latent, layer.rope_key]))
        weights[p + "self_attn.kv_a_layernorm.weight"] = _mx(np.full(len(layer.latent), scale))
        weights[p + "self_attn.embed_q.weight"] = _mx(layer.embed_q)
        weights[p + "self_attn.unembed_out.weight"] = _mx(layer.unembed_out)
        weights[p + "self_attn.o_proj.weight"] = _mx(layer.o)
    nope = (g.kv_heads - components) * g.head_dim
    new = {"model_type": "kimi_linear", "vocab_size": config["vocab_size"],
           "hidden_size": g.hidden, "intermediate_size": config["intermediate_size"],
           "moe_intermediate_size": config["intermediate_size"],
           "num_hidden_layers": config["num_hidden_layers"],
           "num_attention_heads": g.heads, "num_key_value_heads": g.heads, "head_dim": g.head_dim,
           "kv_lora_rank": nope + g.kv_heads * g.head_dim, "q_lora_rank": None,
           "qk_rope_head_dim": components * g.head_dim, "qk_nope_head_dim": nope,
           "v_head_dim": g.head_dim, "mla_use_nope": True, "num_experts": 0, "rope_theta": g.theta,
           "model_max_length": config["max_position_embeddings"],
           "rms_norm_eps": config["rms_norm_eps"],
           "max_position_embeddings": config["max_position_embeddings"],
           "tie_word_embeddings": config.get("tie_word_embeddings", True),
           "linear_attn_config": {"kda_layers": kda, "num_heads": g.heads,
                                  "full_attn_layers": [i + 1 for i in range(
                                      config["num_hidden_layers"]) if i + 1 not in kda],
                                  "head_dim": g.head_dim, "short_conv_kernel_size": 4}}
    return new, weights, {"kda_layers": kda, "rope_components": components,
                         "converted": list(range(config["num_hidden_layers"]))}


# --- MLA + sparse-attention indexer -----------------------------------------------------------

def to_dsa(mla, config: dict, calibration: Calibration, index_topk: int = 256
           ) -> tuple[dict, dict, dict]:
    """deepseek_v32 config and weights from the (healed) MLA conversion `mla`: its attention as
    it is, the query through a full-rank q_lora path (identity rows and a constant channel, so
    `q_a_layernorm` is a near-constant scale), and an indexer whose heads score keys by each
    attention head's rope query and the rope key (both rotate half-split pairs by the same
    `longrope` wavelengths), so it keeps the keys the attention's positional part favours.
    Up to `index_topk` keys the model is the MLA conversion exactly."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    weights = dict(_flat_parameters(mla))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        x = calibration.inputs[i]
        q = _np(weights.pop(p + "q_proj.weight")).reshape(heads, nope + rope, hidden)
        constant = NORM_CHANNEL_SCALE * float(np.linalg.norm(x, axis=1).max())
        scale = float(np.sqrt((np.mean(np.sum(x ** 2, axis=1)) + constant ** 2) / (hidden + 1)))
        weights[p + "q_a_proj.weight"] = _mx(np.eye(hidden + 1, hidden))
        weights[p + "q_a_proj.bias"] = _mx(np.r_[np.zeros(hidden), constant])
        weights[p + "q_a_layernorm.weight"] = _mx(np.r_[np.full(hidden, scale),
                                                         1 / np.sqrt(hidden + 1)])
        weights[p + "q_b_proj.weight"] = _mx(np.pad(q.reshape(-1, hidden), ((0, 0), (0, 1))))
        rope_key = _np(weights[p + "kv_a_proj_with_mqa.weight"])[-rope:]
        keys = x @ rope_key.T
        weights[p + "indexer.wq_b.weight"] = _mx(np.pad(
            q[:, nope:].reshape(-1, hidden), ((0, 0), (0, 1))))
        weights[p + "indexer.wk.weight"] = _mx(rope_key)
        weights[p + "indexer.k_norm.weight"] = _mx(np.full(rope, keys.std()))
        weights[p + "indexer.k_norm.bias"] = mx.zeros(rope)
        weights[p + "indexer.weights_proj.weight"] = _mx(
            np.tile(_unit_gate(x, 1.0), (heads, 1)))
    new = {**config, "model_type": "deepseek_v32", "q_lora_rank": hidden + 1,
           "index_n_heads": heads, "index_head_dim": rope, "index_topk": index_topk,
           "indexer_rope_interleave": False}
    return new, weights, {"index_topk": index_topk}
