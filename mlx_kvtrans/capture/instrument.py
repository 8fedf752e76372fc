"""Every run-time tap and patch of mlx-lm, in one place, safe to nest in any order.

Two kinds of hook, each kept as a list per target so that any number of them can be active at
once and each one leaves exactly as it came:

- module hooks (`hook_module`): callbacks before and/or after one module instance's `__call__`,
  and transforms of its output (applied in the order entered, after the callbacks).
  The instance's class is swapped, once, for a subclass that runs the callbacks (assigning a
  wrapper module would rename or drop its weights); the last hook to leave swaps it back.
- function hooks on a name that mlx-lm's model files look up at call time
  (`gated_delta_update`, `scaled_dot_product_attention`): `observe_function` sees the arguments
  of every call, `replace_function` substitutes the implementation (the latest one entered wins).
  Observers always run, whichever implementation is active, so a capture that records the
  recurrence inputs keeps recording while the chunkwise recurrence replaces the token loop
  (`chunked_recurrence`, the one patch that replaces an implementation).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..backend import fast_math
from ..layouts import gated_delta

# before(module, args, kwargs); after(module, args, kwargs, output); transform(output) -> output
Before = Callable[[nn.Module, tuple, dict], None]
After = Callable[[nn.Module, tuple, dict, Any], None]
Transform = Callable[[Any], Any]


class _ModuleHooks:
    def __init__(self, base: type):
        self.base = base
        self.before: list[Before] = []
        self.after: list[After] = []
        self.transforms: list[Transform] = []

    @property
    def idle(self) -> bool:
        return not self.before and not self.after and not self.transforms


def _hooked_call(self, *args, **kwargs):
    hooks = type(self).__dict__["_kvtrans_hooks"]
    for before in list(hooks.before):
        before(self, args, kwargs)
    out = hooks.base.__call__(self, *args, **kwargs)
    for after in list(hooks.after):
        after(self, args, kwargs, out)
    for transform in list(hooks.transforms):
        out = transform(out)
    return out


def _hooks_of(module: nn.Module) -> _ModuleHooks:
    hooks = type(module).__dict__.get("_kvtrans_hooks")
    if hooks is None:
        base = type(module)
        hooks = _ModuleHooks(base)
        module.__class__ = type("Hooked" + base.__name__, (base,),
                                {"__call__": _hooked_call, "_kvtrans_hooks": hooks})
    return hooks


@contextlib.contextmanager
def hook_module(module: nn.Module, before: Before | None = None, after: After | None = None,
                transform: Transform | None = None) -> Iterator[None]:
    """Within the block, `before` / `after` run around every call of this module instance, and
    `transform` replaces what it returns."""
    hooks = _hooks_of(module)
    for added, kind in ((before, hooks.before), (after, hooks.after),
                        (transform, hooks.transforms)):
        if added:
            kind.append(added)
    try:
        yield
    finally:
        for added, kind in ((before, hooks.before), (after, hooks.after),
                            (transform, hooks.transforms)):
            if added:
                kind.remove(added)
        if hooks.idle:
            module.__class__ = hooks.base


class _FunctionHook:
    """Stands in for a module-level function: observers, then the active implementation."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name
        self.original = getattr(owner, name)
        self.observers: list[Callable] = []
        self.implementations: list[Callable] = []

    def __call__(self, *args, **kwargs):
        for observe in list(self.observers):
            observe(*args, **kwargs)
        implementation = self.implementations[-1] if self.implementations else self.original
        return implementation(*args, **kwargs)

    @property
    def idle(self) -> bool:
        return not self.observers and not self.implementations


_function_hooks: dict[tuple[str, str], _FunctionHook] = {}


@contextlib.contextmanager
def _function_hook(module_name: str, name: str, slot: str, fn: Callable) -> Iterator[None]:
    key = (module_name, name)
    hook = _function_hooks.get(key)
    if hook is None:
        owner = importlib.import_module(module_name)
        hook = _function_hooks[key] = _FunctionHook(owner, name)
        setattr(owner, name, hook)
    getattr(hook, slot).append(fn)
    try:
        yield
    finally:
        getattr(hook, slot).remove(fn)
        if hook.idle:
            setattr(hook.owner, name, hook.original)
            del _function_hooks[key]


def observe_function(module_name: str, name: str, observer: Callable):
    """Within the block, `observer(*args, **kwargs)` sees every call of `module_name.name`."""
    return _function_hook(module_name, name, "observers", observer)


def replace_function(module_name: str, name: str, implementation: Callable):
    """Within the block, calls of `module_name.name` run `implementation` instead."""
    return _function_hook(module_name, name, "implementations", implementation)


RECURRENT_MODULES = ("mlx_lm.models.qwen3_next", "mlx_lm.models.qwen3_5",
                     "mlx_lm.models.kimi_linear")


@contextlib.contextmanager
def chunked_recurrence(chunk_size: int | None = None):
    """Within the block, mlx-lm's linear-attention layers run the chunkwise form
    (`layouts.gated_delta`; for training: 3-10x faster than the token loop on a CPU, and
    differentiable on every device). Capture taps entered before or after keep recording the
    recurrence's inputs."""
    def update(*args, **kwargs):
        return gated_delta.gated_delta_update_chunked(*args, chunk_size=chunk_size, **kwargs)

    with contextlib.ExitStack() as stack:
        for name in RECURRENT_MODULES:
            stack.enter_context(replace_function(name, "gated_delta_update", update))
        yield


def absorbed_wins(attention: nn.Module, length: int, context: int) -> bool:
    """Whether `length` queries over `context` latents cost fewer FLOPs with the queries
    absorbed into the latent space (mlx-lm's decode step) than with the latents expanded into
    every head's keys and values (its prefill)."""
    kv = attention.kv_lora_rank
    nope = attention.qk_nope_head_dim
    v = attention.v_head_dim
    absorbed = length * (nope * kv + 2 * context * kv + kv * v)
    expanded = context * kv * (nope + v) + length * context * (nope + v)
    return absorbed < expanded


SHORT_READ = 64  # tokens up to which a read's attention takes `fast_math`'s softmax off a GPU


@contextlib.contextmanager
def short_reads(model: nn.Module) -> Iterator[None]:
    """Within the block, the model's attention reading a few tokens over a long cache (a new
    turn, the gate's tail) runs as fast as the device allows, the same arithmetic reordered:

    - MLA attends in the latent space as mlx-lm's one-token decode step does, instead of
      expanding every cached latent into keys and values (mlx-lm absorbs at one token only),
      every head as rows of one; the expanded keys and values are built lazily and, unused,
      never computed;
    - off a GPU, the softmax of up to `SHORT_READ` queries takes `fast_math.exp` (MLX's own
      exponential runs one value at a time on a CPU)."""
    attentions = model.__dict__.get("_kvtrans_mla")
    if attentions is None:  # found once per model
        attentions = model.__dict__["_kvtrans_mla"] = [
            m for m in model.modules() if isinstance(getattr(m, "embed_q", None), nn.Module)
            and hasattr(m, "unembed_out") and hasattr(m, "kv_lora_rank")]
    names = model.__dict__.get("_kvtrans_attention_modules")
    if names is None:  # the mlx-lm files whose attention this model calls, found once
        names = {type(m).__module__ for m in model.modules()}
        names = model.__dict__["_kvtrans_attention_modules"] = sorted(
            n for n in names if n.startswith("mlx_lm.models.")
            and hasattr(importlib.import_module(n), "scaled_dot_product_attention"))
    on_cpu = mx.default_device() != mx.gpu
    if not attentions and not on_cpu:
        yield
        return
    pending: dict[str, tuple] = {}  # the latents an attention is about to expand

    def latents_of(attention):
        def before(module, args, kwargs):
            if kwargs.get("transpose", True) is False:  # expanding the cached latents
                pending["latents"] = (attention, args[0])
        return before

    from mlx_lm.models.base import scaled_dot_product_attention as attention_of

    def attend(queries, keys, values, *args, mask=None, **kwargs):
        attention, latents = pending.pop("latents", (None, None))
        if (attention is not None and isinstance(latents, mx.array)
                and absorbed_wins(attention, queries.shape[2], latents.shape[2])):
            return attention.unembed_out(
                one_head(attention.embed_q(queries), latents, *args, mask=mask, **kwargs))
        if (attentions and keys is values and isinstance(keys, mx.array)
                and keys.shape[1] == 1):
            return one_head(queries, keys, *args, mask=mask, **kwargs)  # a decode step
        return short(queries, keys, values, *args, mask=mask, **kwargs)

    def one_head(queries, latents, *args, mask, **kwargs):
        """Every head's queries as rows of one head over the latents that all heads share:
        one matrix product instead of a product per head (MLX's attention outside its fused
        kernels, as on a CPU, reads the keys once per head)."""
        b, h, n, d = queries.shape
        if not isinstance(mask, mx.array) or mask.shape != (b, h, n, latents.shape[2]):
            return short(queries, latents, latents, *args, mask=mask, **kwargs)
        out = short(queries.reshape(b, 1, h * n, d), latents, latents, *args,
                    mask=mask.reshape(b, 1, h * n, -1), tokens=n, **kwargs)
        return out.reshape(b, h, n, -1)

    def short(queries, keys, values, *args, mask=None, tokens=None, **kwargs):
        cache = args[0] if args else kwargs.get("cache")
        tokens = queries.shape[2] if tokens is None else tokens
        if (on_cpu and tokens <= SHORT_READ and not hasattr(cache, "bits")
                and kwargs.get("sinks") is None and "scale" in kwargs
                and queries.dtype == mx.float32):
            return fast_math.attention(queries, keys, values, kwargs["scale"], mask)
        return attention_of(queries, keys, values, *args, mask=mask, **kwargs)

    with contextlib.ExitStack() as stack:
        for attention in attentions:
            stack.enter_context(hook_module(attention.embed_q, before=latents_of(attention)))
        for name in names:
            stack.enter_context(replace_function(name, "scaled_dot_product_attention", attend))
        yield


def fastest_recurrence():
    """Context in which linear-attention layers run the fastest recurrence here: mlx-lm's own
    Metal kernel on a Mac (nothing to change), the chunkwise-parallel form elsewhere."""
    if gated_delta.metal_recurrence_available():
        return contextlib.nullcontext()
    return chunked_recurrence()


def attention_module_name(layer: nn.Module) -> str | None:
    """The mlx-lm module whose `scaled_dot_product_attention` a decoder layer's attention calls
    (None for a layer without softmax attention)."""
    if "self_attn" not in layer:
        return None
    name = type(layer["self_attn"]).__module__
    module = importlib.import_module(name)
    return name if hasattr(module, "scaled_dot_product_attention") else None


@contextlib.contextmanager
def running_layer(model: nn.Module) -> Iterator[dict]:
    """Within the block, `current["layer"]` is the index of the decoder layer running now (for
    function hooks, which do not see which layer called them)."""
    current = {"layer": -1}
    with contextlib.ExitStack() as stack:
        for index, layer in enumerate(model.layers):
            def mark(module, args, kwargs, _index=index):
                current["layer"] = _index
            stack.enter_context(hook_module(layer, before=mark))
        yield current


@contextlib.contextmanager
def recording_indexer_scores(model: nn.Module) -> Iterator[list]:
    """Within the block, every sparse-attention indexer that reads a cache appends its pre-top-k
    scores against all cached keys, (B, queries, keys), to the list yielded."""
    from ..layouts.indexer import indexer_scores

    records: list = []

    def after(indexer, args, kwargs, out):
        cache = kwargs.get("cache", args[3] if len(args) > 3 else None)
        if cache is None:
            return
        x, qr = args[0], args[1]
        keys = cache.keys[..., : cache.offset, :]
        records.append(indexer_scores(indexer, x, qr, keys, cache.offset - x.shape[1]))

    with contextlib.ExitStack() as stack:
        for layer in model.layers:
            indexer = getattr(getattr(layer, "self_attn", None), "indexer", None)
            if indexer is not None:
                stack.enter_context(hook_module(indexer, after=after))
        yield records


def language_model(model: nn.Module) -> nn.Module:
    """The part of an mlx-lm model that holds the decoder and its output head (a vision-language
    or multimodal checkpoint keeps it under `language_model`)."""
    return getattr(model, "language_model", model)


def final_norm(model: nn.Module) -> nn.Module:
    """The norm the decoder applies after its last layer: what the output head reads."""
    return language_model(model).model.norm


def output_head(model: nn.Module) -> Callable:
    """Final-norm rows -> logits, as the model's own `__call__` computes them (its `lm_head`, or
    the input embedding when the two are tied)."""
    lm = language_model(model)
    head = getattr(lm, "lm_head", None)
    return head if head is not None else lm.model.embed_tokens.as_linear


class FinalRows:
    """The last `keep` rows the final norm wrote (batch row 0), one piece per forward, so the
    last forward can be taken back."""

    def __init__(self, keep: int):
        self.keep = keep
        self.pieces: list = []

    def add(self, out) -> None:
        self.pieces.append(out[0, -self.keep:])
        while sum(p.shape[0] for p in self.pieces[1:]) >= self.keep:
            self.pieces.pop(0)  # dropped before it is evaluated: never computed

    def drop_last(self) -> None:
        if self.pieces:
            self.pieces.pop()

    def last(self, n: int):
        """The last `n` rows (or fewer), (n, D), in a buffer of their own (a slice would keep a
        whole prefill chunk's rows alive)."""
        if not self.pieces or n < 1:
            return None
        rows = mx.concatenate(self.pieces, axis=0)[-n:]
        return mx.array(np.array(rows.astype(mx.float32))).astype(rows.dtype)


@contextlib.contextmanager
def head_on_last_token(model: nn.Module) -> Iterator[None]:
    """Within the block, the output head reads only the last row the final norm writes: a
    forward returns the logits of its last token alone, and a prefill pays no head for the
    others (mlx-lm's own prefill never evaluates them; on a real vocabulary the head is a large
    share of a token's arithmetic). Hooks that read the final norm see every row."""
    with hook_module(final_norm(model), transform=lambda out: out[:, -1:]):
        yield


@contextlib.contextmanager
def recording_final_rows(model: nn.Module, keep: int) -> Iterator[FinalRows]:
    """Within the block, the last `keep` final-norm rows of every forward of `model`. Only the
    rows kept are ever evaluated, so a prefill pays no output head for them; the last chunk's
    final layer does run over its rows."""
    rows = FinalRows(keep)
    with hook_module(final_norm(model), after=lambda m, args, kwargs, out: rows.add(out)):
        yield rows
