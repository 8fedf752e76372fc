"""Stage 2's rehearsals: losses that hold what the target computes reading a translated cache
to what it computes reading its own, beside the KL of its output (`problem.Problem.loss`).

- indexer: a DSA target's indexer scores over the prefix (its keys get no gradient through
  the top-k selection otherwise);
- attention: every softmax layer's per-head attention distributions;
- output: every decoder layer's token mixer output, at every continuation position;
- object: each per-token object the translator builds, against the target's own at the same
  capture point: stage 1's reconstruction objective, so a nonlinear term (a map's residual)
  can be trained on it where a closed form has none.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from ..layouts import mixer_of
from ..translators.fidelity import kl_per_token


def indexer_rehearsal(native: list[mx.array], translated: list[mx.array], prefix: int) -> mx.array:
    """Mean KL(softmax(native scores) || softmax(translated scores)) over the prefix keys."""
    losses = [kl_per_token(mx.stop_gradient(n[..., :prefix]), t[..., :prefix]).mean()
              for n, t in zip(native, translated)]
    return mx.stack(losses).mean() if losses else mx.array(0.0)


def attention_rehearsal(native: list[mx.array], translated: list[mx.array]) -> mx.array:
    """Mean over layers, heads and queries of KL(native attention || translated attention)."""
    losses = []
    for n, t in zip(native, translated):
        kl = mx.where(n > 0, n * (mx.log(mx.maximum(n, 1e-30)) - mx.log(t + 1e-9)), 0.0)
        losses.append(kl.sum(-1).mean())
    return mx.stack(losses).mean() if losses else mx.array(0.0)


def relative_error(native: list[mx.array], translated: list[mx.array]) -> mx.array:
    """Mean over the pairs of |translated - native|^2 / |native|^2."""
    losses = [((t.astype(mx.float32) - n) ** 2).sum() / mx.maximum((n ** 2).sum(), 1e-12)
              for n, t in zip(native, translated)]
    return mx.stack(losses).mean() if losses else mx.array(0.0)


# each decoder layer's token mixer output over the continuation
output_rehearsal = relative_error
# each per-token object a map builds, over the translated tokens
object_rehearsal = relative_error


@contextlib.contextmanager
def recording_mixer_outputs(model):
    """Within the block, each decoder layer's token mixer (its linear or softmax attention
    module) appends its output (B, L, hidden) to the list yielded, in layer order."""
    from ..capture.instrument import hook_module

    found: list[mx.array] = []
    with contextlib.ExitStack() as stack:
        for layer in model.layers:
            stack.enter_context(hook_module(mixer_of(layer),
                                            after=lambda m, a, k, out: found.append(out)))
        yield found

