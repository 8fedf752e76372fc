"""Capture -> install -> continue, and the identities between capture points, on every family."""

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache

import mlx_kvtrans as kv
from mlx_kvtrans.translators.install import NotFinite, all_finite, to_engine
from mlx_kvtrans.tools.verify import max_abs_diff
from mlx_kvtrans.zoo.families import FAMILIES

from conftest import HYBRID_RECURRENT

PREFIX, CONTINUATION = 40, 8  # 40 > index_topk (16) of the tiny DSA models: the indexer selects


def tokens(vocab=259, n=PREFIX + CONTINUATION, seed=0):
    return mx.random.randint(0, vocab, (1, n), key=mx.random.key(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_install_reproduces_logits(loaded, family):
    model = loaded(family).model
    toks = tokens()
    full = model(toks)[:, PREFIX:]
    cap = kv.capture(model, toks[:, :PREFIX])
    installed = model(toks[:, PREFIX:], cache=kv.install(model, cap.at(3)))
    assert max_abs_diff(installed, full) <= 1e-5
    # Against the cache the prefill itself filled, the computation is the same: exactly equal.
    assert max_abs_diff(installed, model(toks[:, PREFIX:], cache=cap.engine)) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("point", [1, 2])
def test_raw_and_postnorm_convert_to_engine_cache(loaded, family, point):
    model = loaded(family).model
    cap = kv.capture(model, tokens()[:, :PREFIX])
    converted = to_engine(model, cap.at(point), point)
    for layer, native in zip(converted, cap.at(3)):
        assert layer.keys() == native.keys()
        for name in native:
            assert max_abs_diff(layer[name], native[name]) <= 1e-6, name


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_points_match_layout(loaded, family):
    model = loaded(family).model
    cap = kv.capture(model, tokens()[:, :PREFIX])
    for layer, found in zip(cap.layout.layers, cap.objects):
        for obj in layer.objects:
            for point in obj.capture_points:
                value = found[(obj.name, point)]
                if point == 3:
                    shape = tuple(PREFIX if s == "T" else s for s in obj.engine_shape)
                    assert value.shape == shape
                elif obj.per_token or obj.kind == kv.layouts.ObjectKind.CONV_HISTORY:
                    assert value.shape == (1, PREFIX, obj.token_dim)
                else:
                    assert isinstance(value, kv.layouts.RecurrentInputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_capture_equals_whole(loaded, family):
    model = loaded(family).model
    toks = tokens()[:, :PREFIX]
    whole, chunked = kv.capture(model, toks), kv.capture(model, toks, chunk_size=13)
    for a, b in zip(whole.objects, chunked.objects):
        for key in a:
            xs = a[key].arrays() if isinstance(a[key], kv.layouts.RecurrentInputs) else [a[key]]
            ys = b[key].arrays() if isinstance(b[key], kv.layouts.RecurrentInputs) else [b[key]]
            for x, y in zip(xs, ys):
                assert max_abs_diff(x, y) <= 1e-5, key


@pytest.mark.parametrize("family", HYBRID_RECURRENT)
def test_replay_reproduces_state(loaded, family):
    model = loaded(family).model
    cap = kv.capture(model, tokens()[:, :PREFIX])
    replayed = 0
    for layer in cap.layout.layers:
        if layer.mixer not in ("gdn", "kda"):
            continue
        inputs = cap.layer(layer.index, 2)["state"]
        native = cap.layer(layer.index, 3)["state"]
        _, whole = kv.replay(layer.cache, inputs)
        _, chunked = kv.replay(layer.cache, inputs, chunk_size=7)
        # From a given state: the first 25 tokens, then the rest starting from their state.
        _, first = kv.replay(layer.cache, inputs.slice(0, 25))
        _, resumed = kv.replay(layer.cache, inputs.slice(25, PREFIX), state=first)
        for state in (whole, chunked, resumed):
            assert max_abs_diff(state, native) <= 1e-6
        replayed += 1
    assert replayed == 3


@pytest.mark.parametrize("family", HYBRID_RECURRENT)
def test_rows_before_the_convolution_give_the_recurrence_inputs(loaded, family):
    """The rows entering a layer's short convolution, passed through it after the history
    before them, are its recurrence inputs: replay's `convolve` rebuilds the state exactly."""
    model = loaded(family).model
    cap = kv.capture(model, tokens()[:, :PREFIX])
    checked = 0
    for layer in cap.layout.layers:
        if layer.mixer not in ("gdn", "kda"):
            continue
        cache, native = layer.cache, cap.layer(layer.index, 2)["state"]
        rows = {name: cap.layer(layer.index, 1)[name] for name in cache.conv_names}
        raw = cache.raw_inputs(rows, native)
        T = raw.length
        whole = cache.convolved(raw, {})
        # the tokens after the first 25, after the conv history those leave
        before = {name: cache.conv_history(r[:, :25]) for name, r in rows.items()}
        rest = cache.convolved(raw.slice(25, T), before)
        for got, want in ((whole, native), (rest, native.slice(25, T))):
            assert max_abs_diff(got.k, want.k) <= 1e-5 and max_abs_diff(got.v, want.v) <= 1e-5
        _, state = kv.replay(cache, whole)
        assert max_abs_diff(state, cap.layer(layer.index, 3)["state"]) <= 1e-5
        checked += 1
    assert checked == 3


@pytest.mark.parametrize("family", HYBRID_RECURRENT)
def test_raw_rows_install_and_are_recorded_as_the_inputs_they_make(loaded, family):
    """Installed, replay's rows before the convolution make the native cache, onto a fresh
    cache and onto one holding the first tokens; a session records them convolved."""
    from mlx_kvtrans.layouts.linear_attention import RawRecurrentInputs
    from mlx_kvtrans.session.switching import _recorded

    model = loaded(family).model
    toks = tokens()[:, :PREFIX]
    cap = kv.capture(model, toks)
    layout = cap.layout

    def raw_span(start, stop):
        objects, points = [], []
        for layer in layout.layers:
            found, made = cap.layer(layer.index, 1), {}
            for obj in layer.objects:
                if obj.kind == kv.layouts.ObjectKind.RECURRENT_STATE:
                    native = cap.layer(layer.index, 2)["state"].slice(start, stop)
                    made[obj.name] = layer.cache.raw_inputs(
                        {n: found[n][:, start:stop] for n in layer.cache.conv_names}, native)
                else:
                    made[obj.name] = cap.layer(layer.index, 1)[obj.name][:, start:stop]
            objects.append(made)
            points.append({n: 2 if isinstance(v, RawRecurrentInputs) else 1
                           for n, v in made.items()})
        return objects, points

    tail = mx.array([[5, 9, 2]])
    native = model(tail, cache=kv.install(layout, cap.at(3)))
    for cut in (0, 25):
        cache = None
        if cut:
            head, head_points = raw_span(0, cut)
            cache = kv.install(layout, head, head_points)
        objects, points = raw_span(cut, PREFIX)
        before = [layer.cache.read_engine(c) if cache else {}
                  for layer, c in zip(layout.layers, cache or [None] * len(layout.layers))]
        cache = kv.install(layout, objects, points, offset=cut, cache=cache)
        assert max_abs_diff(model(tail, cache=cache), native) <= 1e-4
        for layer, made, prior in zip(layout.layers, objects, before):
            for value in made.values():
                if isinstance(value, RawRecurrentInputs):
                    recorded = _recorded(layer.cache, value, prior)
                    want = cap.layer(layer.index, 2)["state"].slice(cut, PREFIX)
                    assert type(recorded) is kv.layouts.RecurrentInputs
                    assert max_abs_diff(recorded.k, want.k) <= 1e-5


@pytest.mark.parametrize("family", HYBRID_RECURRENT)
def test_conv_history_is_last_raw_rows(loaded, family):
    model = loaded(family).model
    short = tokens()[:, :2]  # fewer tokens than K-1: the history is zero-padded in front
    for toks in (tokens()[:, :PREFIX], short):
        cap = kv.capture(model, toks)
        for layer in cap.layout.layers:
            for obj in layer.objects:
                if obj.kind == kv.layouts.ObjectKind.CONV_HISTORY:
                    rows = cap.objects[layer.index][(obj.name, 1)]
                    history = cap.objects[layer.index][(obj.name, 3)]
                    k1 = history.shape[1]
                    padded = mx.concatenate([mx.zeros((1, k1, rows.shape[2])), rows], axis=1)
                    assert max_abs_diff(padded[:, -k1:], history) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_cache_file_round_trip(loaded, family, tmp_path):
    lm = loaded(family)
    model, toks = lm.model, tokens()
    cap = kv.capture(model, toks[:, :PREFIX])
    expected = model(toks[:, PREFIX:], cache=kv.install(model, cap.at(3)))
    path = kv.write_prompt_cache(tmp_path / "cache.safetensors", kv.install(model, cap.at(3)),
                                 str(lm.path))
    caches, metadata = load_prompt_cache(str(path), return_metadata=True)
    assert metadata["model"] == str(lm.path) and "tokenizer_config" in metadata
    assert max_abs_diff(model(toks[:, PREFIX:], cache=caches), expected) <= 1e-6
    objects, _ = kv.read_prompt_cache(path, model)
    assert max_abs_diff(model(toks[:, PREFIX:], cache=kv.install(model, objects)), expected) <= 1e-6


@pytest.mark.parametrize("family", ["qwen3", "kimi_linear", "deepseek_v32"])
def test_mlx_lm_generation_continues_from_installed_cache(loaded, family):
    from mlx_lm.generate import generate_step

    model = loaded(family).model
    toks = tokens()
    prompt, last = toks[0, :PREFIX - 1], toks[0, PREFIX - 1:PREFIX]

    def greedy(cache):
        steps = generate_step(last, model, prompt_cache=cache, max_tokens=6)
        return [int(t) for t, _ in steps]

    cap = kv.capture(model, prompt)
    assert greedy(kv.install(model, cap.at(1), point=1)) == greedy(cap.engine)


def test_install_rejects_wrong_layer_count(loaded):
    model = loaded("qwen3").model
    cap = kv.capture(model, tokens()[:, :8])
    with pytest.raises(ValueError):
        kv.install(model, cap.at(3)[:-1])


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "deepseek_v32"])
def test_checks_hold_in_bfloat16(model_dirs, family):
    """Real checkpoints run in bf16 on a Mac: the same identities hold there."""
    from mlx_kvtrans.tools.verify import run_checks

    lm = kv.load(str(model_dirs(family)))
    lm.model.set_dtype(mx.bfloat16)
    checks = run_checks(lm.model, lm.tokenizer)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert kv.layout_of(lm.model).layers[-1].objects[0].dtype == "bfloat16"


def test_checks_hold_on_a_quantized_model(model_dirs):
    import mlx.nn as nn

    from mlx_kvtrans.tools.verify import run_checks

    lm = kv.load(str(model_dirs("qwen3")))
    nn.quantize(lm.model, group_size=32, bits=8)
    assert kv.layout_of(lm.model).layers[0].cache.object("keys").engine_shape == (1, 2, "T", 16)
    assert all(c.passed for c in run_checks(lm.model, lm.tokenizer))


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_continues_a_cache_and_append_grows_one(loaded, family):
    """Segment by segment: capturing the second half on the first half's cache gives that
    half's objects, and appending converted (1) objects to an installed cache continues exactly."""
    model = loaded(family).model
    toks = tokens()
    first = kv.capture(model, toks[:, :24])
    second = kv.capture(model, toks[:, 24:PREFIX], cache=first.engine)
    whole = kv.capture(model, toks[:, :PREFIX])
    layout = whole.layout
    cache = kv.install(model, kv.capture(model, toks[:, :24]).at(3))
    assert kv.install(model, second.at(1), 1, offset=24, cache=cache) is cache  # grown in place
    for layer in layout.layers:
        for obj in layer.objects:  # per-token objects of the half equal the whole's slice
            got = second.objects[layer.index].get((obj.name, 1))
            want = whole.objects[layer.index].get((obj.name, 1))
            if got is not None and not isinstance(got, kv.layouts.RecurrentInputs):
                assert max_abs_diff(got, want[:, 24:]) <= 1e-5
    expected = model(toks[:, PREFIX:], cache=whole.engine)
    assert max_abs_diff(model(toks[:, PREFIX:], cache=cache), expected) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_extending_a_cache_equals_installing_the_concatenation(loaded, family):
    """`install(..., cache=c)` of a span's (1) objects after the tokens `c` holds gives the
    cache that installing the whole run at once gives: bit for bit, but for a recurrent state,
    which the replay reaches in two runs instead of one (the same recurrence, rounded in
    another order)."""
    model = loaded(family).model
    objects = kv.capture(model, tokens()[:, :PREFIX]).at(1)
    layout = kv.layout_of(model)

    def span(lo, hi):
        return [{k: v.slice(lo, hi) if isinstance(v, kv.layouts.RecurrentInputs) else v[:, lo:hi]
                 for k, v in layer.items()} for layer in objects]

    whole = kv.install(model, objects, 1)
    extended = kv.install(model, span(25, PREFIX), 1, offset=25,
                          cache=kv.install(model, span(0, 25), 1))
    for layer, a, b in zip(layout.layers, whole, extended):
        mine, theirs = layer.cache.read_engine(a), layer.cache.read_engine(b)
        for name in mine:
            if layer.cache.object(name).kind == kv.layouts.ObjectKind.RECURRENT_STATE:
                assert max_abs_diff(mine[name], theirs[name]) <= 1e-6, (layer.index, name)
            else:
                assert mx.array_equal(mine[name], theirs[name]).item(), (layer.index, name)
    continuation = tokens()[:, PREFIX:]
    assert max_abs_diff(model(continuation, cache=whole), model(continuation, cache=extended)) \
        <= 1e-5


def test_install_refuses_a_cache_of_another_layer_count(loaded):
    model = loaded("qwen3").model
    objects = kv.capture(model, tokens()[:, :PREFIX]).at(1)
    cache = kv.install(model, objects, 1)
    with pytest.raises(ValueError, match="a cache of"):
        kv.install(model, objects, 1, offset=PREFIX, cache=cache[:-1])


def test_install_refuses_objects_that_are_not_finite(loaded):
    model = loaded("qwen3").model
    objects = kv.capture(model, tokens()[:, :PREFIX]).at(1)
    cache = kv.install(model, objects, 1)
    before = [c.offset for c in cache]
    poisoned = [{k: v * mx.nan for k, v in layer.items()} for layer in objects]
    with pytest.raises(NotFinite):
        kv.install(model, poisoned, 1, offset=PREFIX, cache=cache, finite=True)
    assert [c.offset for c in cache] == before  # refused before any cache grew


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_one_value_not_finite_is_found_in_any_dtype(bad, dtype):
    """One bad value among many is found, and large finite float16 values whose float16 sum
    would overflow are not mistaken for it."""
    big = mx.full((4, 4096), 60000.0 if dtype == mx.float16 else 1.0, dtype)
    assert all_finite([{"a": big, "b": -big[:1]}, {"c": big}])
    poisoned = mx.concatenate([big[:, :7], mx.full((4, 1), bad, dtype), big[:, 8:]], axis=1)
    assert not all_finite([{"a": big}, {"b": poisoned}])
