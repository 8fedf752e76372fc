"""One process of a sharded-model check, run by `tests/test_sharding.py` under `mlx.launch`.

Every process loads the source and the target twice: whole, and (those SHARDED names: target,
source or both) sharded by mlx-lm (`tensor`: `shard(group)`; `pipeline`: `model.pipeline(group)`,
on the language model). It installs the shipped translator's translation of a held-out prompt
from the whole source into the whole target and from the other pair, checks its share of the
second's caches against the first's split the same way and decodes greedily from both; then
holds a conversation through a `Session` over each pair, switching both ways. It writes what it
found to OUT/rank<R>.json.

    python tests/sharded_worker.py tensor|pipeline SOURCE TARGET TRANSLATOR OUT SINK SHARDED
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx_kvtrans  # noqa: F401  first: fast BLAS
import mlx.core as mx

from mlx_kvtrans import Session, load, load_translator, translate_cache
from mlx_kvtrans.models import weights_dir
from mlx_kvtrans.translators.sharding import shard_model, shards_of
from mlx_kvtrans.translators import artifact

STEPS = 8


def decode(model, cache, first: mx.array) -> tuple[list[int], list[mx.array]]:
    tokens, logits, token = [], [], first
    for _ in range(STEPS):
        out = model(token.reshape(1, 1), cache=cache)[:, -1].astype(mx.float32)
        token = out.argmax(-1)
        mx.eval(out, token)
        logits.append(out)
        tokens.append(token.item())
    return tokens, logits


def conversation(pair, translator: str, prompt: mx.array, sink: int) -> dict:
    """A session over `pair`: the source reads the prompt and replies, the conversation
    switches to the target, which replies, and back (translated where a shipped translator
    goes that way, else re-read): the tokens and what each switch did."""
    source, target = pair
    translators = {("source", "target"): load_translator(translator, source, target)}
    back = artifact.shipped(target.name, source.name)
    if back is not None:
        translators[("target", "source")] = load_translator(back, target, source)
    s = Session({"source": source, "target": target}, translators, sink=sink)
    s.add(prompt.tolist())
    list(s.generate(6))
    switches = []
    for model, words in (("target", "And the number?"), ("source", "Once more?")):
        switches.append(s.switch(model))
        s.add(source.tokenizer.encode(words))
        list(s.generate(6))
    return {"tokens": s.tokens[len(prompt):],
            "switches": [[w.status, w.tokens_translated, w.tokens_tail, w.tokens_fallback,
                          str(w.gate)] for w in switches]}


def main(kind: str, source: str, target: str, translator: str, out: str, sink: int,
         which: str):
    group = mx.distributed.init()
    src, whole = load(source), load(target)
    src_sharded, sharded = load(source), load(target)
    if which in ("target", "both"):
        shard_model(sharded.model, kind, group)
    if which in ("source", "both"):
        shard_model(src_sharded.model, kind, group)
        assert shards_of(src_sharded.model) is not None
    shards = shards_of(sharded.model)
    tr = load_translator(translator, src, whole)
    text = (weights_dir() / "corpus" / "validation.txt").read_text()[:4000]
    prompt = mx.array(whole.tokenizer.encode(text)[:300])
    whole_cache = translate_cache(tr, src.model, whole.model, prompt, sink=sink)
    sharded_cache = translate_cache(tr, src_sharded.model, sharded.model, prompt, sink=sink)
    held = range(len(whole_cache)) if shards is None else shards.layers
    rank = 0 if shards is None else shards.rank
    assert len(held) == len(sharded_cache)
    cache_difference = 0.0
    for i, mine in zip(held, sharded_cache):
        theirs = whole_cache[i]
        for a, b in zip(mine.state, theirs.state):
            if not isinstance(a, mx.array):
                continue
            if a.shape != b.shape:  # heads split: this process's block of the head axis
                axis = next(d for d in range(a.ndim) if a.shape[d] != b.shape[d])
                b = mx.take(b, mx.arange(rank * a.shape[axis], (rank + 1) * a.shape[axis]),
                            axis=axis)
            cache_difference = max(cache_difference, mx.abs(
                a.astype(mx.float32) - b.astype(mx.float32)).max().item())
    first = prompt[-1:]
    tokens_whole, logits_whole = decode(whole.model, whole_cache, first)
    tokens_sharded, logits_sharded = decode(sharded.model, sharded_cache, first)
    logit_difference = max(mx.abs(a - b).max().item()
                           for a, b in zip(logits_whole, logits_sharded))
    sessions = {name: conversation(pair, translator, prompt, sink)
                for name, pair in (("whole", (src, whole)), ("sharded", (src_sharded, sharded)))}
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps({
        "sessions": sessions, "rank": group.rank(), "size": group.size(),
        "kind": None if shards is None else shards.kind, "layers": list(held),
        "cache_difference": cache_difference,
        "tokens_whole": tokens_whole, "tokens_sharded": tokens_sharded,
        "logit_difference": logit_difference,
        "offsets": [c.offset for c in sharded_cache if hasattr(c, "offset")]}))


if __name__ == "__main__":
    main(*sys.argv[1:6], int(sys.argv[6]), sys.argv[7])
