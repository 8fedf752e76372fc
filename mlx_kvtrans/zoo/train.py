"""Train a zoo model from its curriculum, with checkpoints that resume where they stopped.

Float32 on the CPU (bf16 is ~8x slower there). Linear-attention families train with the
chunkwise-parallel recurrence (`mlx_kvtrans.layouts.gated_delta`); the saved models are plain
mlx-lm checkpoints. The DSA model's indexer gets its own loss (the LM loss gives it no gradient: the
top-k selection is not differentiable): KL from the layer's attention distribution to the
indexer's score distribution, with dense attention for the first steps while it learns.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from ..evaluation.needles import HELD_OUT_SEED, held_out_filler, needle_recall, needle_scores
from ..evaluation.perplexity import perplexity, unigram_perplexity
from ..files import sha256_file
from ..capture.instrument import chunked_recurrence, hook_module, observe_function
from ..layouts.indexer import indexer_keys, indexer_scores
from .corpus import HELD_OUT, build_corpus, check_against
from .data import SampleMaker, TokenStream, make_batch, needle_filler
from .gates import reference_gate_init
from .curricula import CURRICULA, TOKENIZERS, Curriculum
from .tokenizer import save_tokenizer, special_token_ids, train_bpe

RECURRENT = ("qwen3_5", "qwen3_next", "kimi_linear")


# -- shared assets -----------------------------------------------------------------------------
def ensure_corpus(workdir: Path, progress=print, record: bool = False) -> Path:
    """The corpus in `workdir/corpus`, built once and checked against the zoo's record
    (`weights/corpus.json`): a build that differs stops with the difference, the record kept.
    With `record`, the build becomes the record instead, and its held-out splits ship."""
    from ..models import weights_dir

    corpus = workdir / "corpus"
    if not (corpus / "corpus.json").exists():
        build_corpus(corpus, workdir / "sources", progress=progress)
    summary = json.loads((corpus / "corpus.json").read_text())
    recorded = weights_dir() / "corpus.json"
    if record:
        shutil.copy(corpus / "corpus.json", recorded)
        (weights_dir() / "corpus").mkdir(exist_ok=True)
        for split in HELD_OUT:
            shutil.copy(corpus / f"{split}.txt", weights_dir() / "corpus" / f"{split}.txt")
    elif recorded.exists():
        check_against(summary, json.loads(recorded.read_text()))
    return corpus


def ensure_tokenizer(weights: Path, corpus: Path, name: str = "tokenizer"):
    """A zoo tokenizer (`TOKENIZERS`): `weights/NAME/`, trained on the corpus once."""
    from tokenizers import Tokenizer

    from .corpus import read_split

    path = weights / name / "tokenizer.json"
    if not path.exists():
        tok = train_bpe(read_split(corpus, "train"), TOKENIZERS[name])
        save_tokenizer(tok, path.parent)
    return Tokenizer.from_file(str(path))


# -- the DSA indexer's own loss ----------------------------------------------------------------
@contextlib.contextmanager
def indexer_supervision(model):
    """Within the block, each DSA layer's forward appends (attention probs, indexer scores)."""
    pairs: list[tuple[mx.array, mx.array]] = []
    current = {}

    def index(attn, args, kwargs):
        x_in = mx.stop_gradient(args[0])
        qr = mx.stop_gradient(attn.q_a_layernorm(attn.q_a_proj(x_in)))
        current["index"] = indexer_scores(attn.indexer, x_in, qr, indexer_keys(attn.indexer, x_in))

    def attention(queries, keys, values, cache, scale, mask, **kw):
        scores = (queries * scale) @ keys.swapaxes(-1, -2) + mask  # mask = rope scores (+ -inf)
        attn = mx.stop_gradient(mx.softmax(scores.astype(mx.float32), axis=-1).mean(axis=1))
        pairs.append((attn, current.pop("index")))

    with contextlib.ExitStack() as stack:
        for layer in model.layers:
            stack.enter_context(hook_module(layer.self_attn, before=index))
        stack.enter_context(observe_function(type(model).__module__,
                                             "scaled_dot_product_attention", attention))
        yield pairs


def indexer_kl(pairs) -> mx.array:
    """Mean over layers and queries of KL(attention || softmax(indexer scores)), causal."""
    losses = []
    for attn, scores in pairs:
        L = scores.shape[-1]
        causal = mx.tril(mx.ones((L, L), dtype=mx.bool_))
        logq = nn.log_softmax(mx.where(causal, scores.astype(mx.float32), -1e9), axis=-1)
        kl = mx.where(causal, attn * (mx.log(attn + 1e-9) - logq), 0.0).sum(-1)
        losses.append(kl.mean())
    return mx.stack(losses).mean()


# -- training ---------------------------------------------------------------------------------
# Every PROBE_EVERY steps: recall and digit loss on 16 needles at the translators' fitting
# length and twice it (the lengths the zoo's bar reads), drawn from seeds that neither training
# nor the shipped evaluation uses; every PROBE_LONG_EVERY steps at the longest training prompt too.
PROBE_EVERY = 100
PROBE_LONG_EVERY = 500
PROBE_SEED = HELD_OUT_SEED + 500_000


def build_config(curriculum: Curriculum, tok, weights: Path) -> dict:
    if curriculum.init_from and not curriculum.config:  # the same architecture, trained on
        return json.loads((weights / curriculum.init_from / "config.json").read_text())
    config = json.loads(json.dumps(curriculum.config))
    target = config.get("text_config", config)
    target["vocab_size"] = tok.get_vocab_size()
    target.update(special_token_ids(tok))
    return config


# the last commit whose weights/seeds/ held every seed's weights (weights/ has a 64 MB budget)
SEEDS_COMMIT = "e069d52"


def seed_weights(directory: Path) -> Path:
    """`directory`, the model a recipe continues from, when its weights are here; a seed that
    ships its manifest and config alone says where its weights are."""
    if not (directory / "model.safetensors").exists():
        from ..errors import KvtransError

        relative = f"weights/{directory.parent.name}/{directory.name}"
        raise KvtransError(f"{relative} ships without its weights (weights/ is at its budget); "
                           f"restore them from the repository's history: git checkout "
                           f"{SEEDS_COMMIT} -- {relative}/model.safetensors")
    return directory


def load_initial_weights(model, directory: Path, log=print) -> None:
    """Another zoo model's shipped (bf16) weights, trained on in float32. A model of another
    class, such as a sparse-attention model continued from a dense MLA one (as DeepSeek-V3.2 was
    from V3.1), takes every weight whose name and shape match once a multimodal wrapper's
    `language_model.` prefix is dropped; only what the other model lacks (the indexer) starts
    fresh."""
    from ..models import cast_parameters

    own = dict(tree_flatten(model.parameters()))
    given = mx.load(str(directory / "model.safetensors"))
    if not set(given) <= set(own):
        given = {k.removeprefix("language_model."): v for k, v in given.items()}
    matched = {k: v for k, v in given.items() if k in own and own[k].shape == v.shape}
    fresh = sorted(k for k in own if k not in matched)
    if any("indexer" not in k for k in fresh):
        raise ValueError(f"{directory.name} lacks weights this model needs: "
                         f"{[k for k in fresh if 'indexer' not in k][:4]}")
    model.load_weights(list(matched.items()), strict=False)
    cast_parameters(model, mx.float32)
    if fresh:
        log(f"initialised from {directory.name}; fresh: {len(fresh)} indexer tensors")


def _schedule(c: Curriculum):
    """Warm-up, then the full rate, then (the last `decay_share` of steps) cosine to a tenth.

    Recall can take thousands of steps to appear (full MLA: suddenly, after ~2,400), so the rate
    is held rather than decayed from the start."""
    warm = optim.linear_schedule(1e-7, c.lr, c.warmup)
    if c.restart:
        if c.decay_share:
            raise ValueError(f"{c.alias}: a restart follows a cosine stage (decay_share 0)")
        at, rate = c.restart
        first = optim.cosine_decay(c.lr, max(1, at - c.warmup), c.lr * 0.1)
        ramp = optim.linear_schedule(c.lr * 0.1, rate, c.warmup)
        second = optim.cosine_decay(rate, max(1, c.steps - at - c.warmup), rate * 0.1)
        return optim.join_schedules([warm, first, ramp, second],
                                    [c.warmup, at, at + c.warmup])
    if not c.decay_share:
        decay = optim.cosine_decay(c.lr, max(1, c.steps - c.warmup),
                                   c.lr * 0.1)
        return optim.join_schedules([warm, decay], [c.warmup])
    decay_steps = max(1, int(c.decay_share * c.steps))
    hold = max(c.warmup + 1, c.steps - decay_steps)
    return optim.join_schedules(
        [warm, lambda _: c.lr, optim.cosine_decay(c.lr, decay_steps, c.lr * 0.1)],
        [c.warmup, hold])


def train(alias: str, workdir: Path, weights: Path, log=print, eval_samples: int = 50,
          max_minutes: float | None = None, on_step=None, out: Path | None = None
          ) -> dict | None:
    """Train (or resume) `alias`; when done, write `weights/alias` (or `out`) with its manifest.

    `log(line)` gets a line every 25 steps; `on_step(step, total, record)` every step.
    Returns the manifest, or None when `max_minutes` ran out first (the checkpoint is kept).
    """
    curriculum = CURRICULA[alias]
    mx.random.seed(curriculum.seed)
    corpus = ensure_corpus(workdir, progress=log)
    tok = ensure_tokenizer(weights, corpus, curriculum.tokenizer_name)
    stream = TokenStream(corpus, "train", tok)
    maker = SampleMaker(tok, needle_filler(corpus))
    model = _initial_model(curriculum, tok, weights, log)

    run = workdir / alias
    run.mkdir(parents=True, exist_ok=True)
    optimizer = optim.AdamW(learning_rate=_schedule(curriculum), weight_decay=0.01)
    state = {"step": 0, "seconds": 0.0, "tokens": 0}
    if (run / "state.json").exists():
        state = json.loads((run / "state.json").read_text())
        model.load_weights(str(run / "model.safetensors"))
        optimizer.state = tree_unflatten(list(mx.load(str(run / "optimizer.safetensors")).items()))
        log(f"{alias}: resuming at step {state['step']}")
    mx.eval(model.parameters())

    probe_filler = held_out_filler()

    def encode(text):
        return tok.encode(text).ids

    dsa = curriculum.family in ("deepseek_v32", "glm_moe_dsa")
    top_k = [layer.self_attn.indexer.index_topk for layer in model.layers] if dsa else []
    step_fn = nn.value_and_grad(model, _loss(dsa))
    recurrence = (chunked_recurrence() if curriculum.family in RECURRENT
                  else contextlib.nullcontext())
    started = time.perf_counter() - state["seconds"]
    last_save = time.perf_counter()

    def save_checkpoint():
        state["seconds"] = time.perf_counter() - started
        mx.save_safetensors(str(run / "model.safetensors"), dict(tree_flatten(model.parameters())))
        mx.save_safetensors(str(run / "optimizer.safetensors"),
                            dict(tree_flatten(optimizer.state)))
        (run / "state.json").write_text(json.dumps(state))

    with recurrence, open(run / "log.jsonl", "a") as logf:
        while state["step"] < curriculum.steps:
            step = state["step"]
            if dsa:  # dense attention while the indexer learns, then sparse
                dense = step < curriculum.dense_warmup * curriculum.steps
                for layer, k in zip(model.layers, top_k):
                    layer.self_attn.indexer.index_topk = 1 << 30 if dense else k
            batch, length = curriculum.shape_at(step)
            tokens, weights_ = make_batch(step, curriculum.seed, batch, length, stream, maker,
                                          curriculum.mix)
            (loss, (ce, aux)), grads = step_fn(model, mx.array(tokens), mx.array(weights_))
            optimizer.update(model, grads)
            mx.eval(model.parameters(), optimizer.state, loss)
            state["step"] += 1
            state["tokens"] += int(tokens.size - len(tokens))
            record = {"step": state["step"], "loss": float(loss), "ce": float(ce),
                      "indexer_kl": float(aux), "seconds": round(time.perf_counter() - started, 1)}
            if state["step"] % PROBE_EVERY == 0:  # copying shows in the digit loss first
                record["probe"] = _probe(model, encode, state["step"], curriculum, probe_filler)
            logf.write(json.dumps(record) + "\n")
            if on_step:
                on_step(state["step"], curriculum.steps, record)
            if state["step"] % 25 == 0 or state["step"] == curriculum.steps:
                logf.flush()
                log(_step_line(alias, curriculum.steps, record))
            if time.perf_counter() - last_save > 120 or state["step"] == curriculum.steps:
                save_checkpoint()
                last_save = time.perf_counter()
            if max_minutes and time.perf_counter() - started > max_minutes * 60 \
                    and state["step"] < curriculum.steps:
                save_checkpoint()
                return None
    return ship(alias, workdir, weights, eval_samples, out)


def _initial_model(curriculum, tok, weights: Path, log):
    """The curriculum's model before training: its seed's weights, or fresh ones."""
    from mlx_lm.utils import _get_classes

    config = build_config(curriculum, tok, weights)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if curriculum.init_from:
        load_initial_weights(model, seed_weights(weights / curriculum.init_from), log)
    elif curriculum.gate_init == "reference":
        reference_gate_init(model, mx.random.key(curriculum.seed))
    model.train()
    return model


def _loss(dsa: bool):
    """The training loss: weighted cross-entropy, and for an indexer model the KL that
    teaches its indexer the attention's choice."""
    def loss_fn(model, tokens, weights_):
        with contextlib.ExitStack() as stack:
            pairs = stack.enter_context(indexer_supervision(model)) if dsa else None
            logits = model(tokens[:, :-1])
            ce = nn.losses.cross_entropy(logits, tokens[:, 1:])
            loss = (ce * weights_).sum() / weights_.sum()
            if dsa:
                aux = indexer_kl(pairs)
                return loss + aux, (ce.mean(), aux)
            return loss, (ce.mean(), mx.array(0.0))
    return loss_fn


def _step_line(alias: str, steps: int, record: dict) -> str:
    """A training step's record as the log shows it."""
    probe = "".join(f" needle@{n} {p['recall']:.2f} ({p['digit_nll']:.2f})"
                    for n, p in record.get("probe", {}).items())
    return (f"{alias} step {record['step']}/{steps} loss {record['loss']:.3f} "
            f"ce {record['ce']:.3f} kl {record['indexer_kl']:.3f}{probe} "
            f"{record['seconds'] / 60:.1f} min")


def _probe(model, encode, step: int, curriculum, filler) -> dict:
    """Needle recall and digit loss at the short lengths (and now and then at the trained
    length): copying shows in the digit loss first."""
    lengths = list(NEEDLE_LENGTHS[:2])
    if step % PROBE_LONG_EVERY == 0 and curriculum.length not in lengths:
        lengths.append(curriculum.length)
    probe = {}
    for n in lengths:
        recall, digit_nll = needle_scores(model, encode, n, samples=16, filler=filler,
                                          seed=PROBE_SEED)
        probe[str(n)] = {"recall": recall, "digit_nll": digit_nll}
    return probe


SHIPPED_DTYPE = mx.bfloat16  # half the bytes of float32; computed in float32 on a CPU


def ship(alias: str, workdir: Path, weights: Path, samples: int = 50, out: Path | None = None
         ) -> dict:
    """Write `weights/alias` or `out` (bf16 weights, config, tokenizer) from the finished
    checkpoint, then measure the written files as a user loads them and write the manifest."""
    from mlx_lm.utils import _get_classes, save_config, save_model

    from ..models import cast_parameters, load

    curriculum = CURRICULA[alias]
    run = workdir / alias
    state = json.loads((run / "state.json").read_text())
    if state["step"] < curriculum.steps:
        raise RuntimeError(f"{alias} has trained {state['step']} of {curriculum.steps} steps")
    corpus = ensure_corpus(workdir)
    tok = ensure_tokenizer(weights, corpus, curriculum.tokenizer_name)
    config = build_config(curriculum, tok, weights)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.load_weights(str(run / "model.safetensors"))
    cast_parameters(model, SHIPPED_DTYPE)
    out = Path(out) if out is not None else weights / alias
    if out.exists():
        shutil.rmtree(out)
    save_model(out, model)
    (out / "model.safetensors.index.json").unlink(missing_ok=True)  # one shard: not needed
    save_config(dict(config), out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(weights / curriculum.tokenizer_name / name, out / name)
    shipped = load(str(out)).model
    manifest = evaluate_and_describe(alias, shipped, tok, corpus,
                                     TokenStream(corpus, "train", tok), state, samples)
    manifest["shipped_dtype"] = str(SHIPPED_DTYPE).removeprefix("mlx.core.")
    manifest["files"] = {p.name: sha256_file(p) for p in sorted(out.iterdir())
                         if p.is_file() and p.name != "manifest.json"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def evaluate_and_describe(alias, model, tok, corpus, stream, state, samples) -> dict:
    curriculum = CURRICULA[alias]
    val = TokenStream(corpus, "validation", tok)
    ppl = perplexity(model, val.ids, curriculum.length)
    uni = unigram_perplexity(stream.ids, val.ids, tok.get_vocab_size())
    recall = needle_recall(model, lambda s: tok.encode(s).ids, NEEDLE_LENGTHS, samples=samples)
    return {
        "alias": alias,
        "model_type": curriculum.family,
        "role": curriculum.role,
        "parameters": sum(v.size for _, v in tree_flatten(model.parameters())),
        "curriculum": curriculum.to_json(),
        "tokens_seen": state["tokens"],
        "training_minutes": round(state["seconds"] / 60, 1),
        "held_out_perplexity": round(ppl, 2),
        "unigram_perplexity": round(uni, 2),
        "needle_recall": {str(k): v for k, v in recall.items()},
        "needle_samples": samples,
        "longest_training_prompt": curriculum.length,
        "corpus": json.loads((corpus / "corpus.json").read_text())["splits"]["train"]["sha256"],
        **({"state_ablation": state_ablation(model, tok, val.ids)}
           if curriculum.family in RECURRENT else {}),
    }


# Every zoo model's recall is measured at the translators' fitting length and 2x-8x it, the
# lengths every fidelity table reads the zoo at, whatever rows the model trained on.
NEEDLE_LENGTHS = (256, 512, 1024, 2048)
STATE_BAR = {"length": 1024, "kl_share": 0.3, "recall_drop": 0.3}


def state_ablation(model, tok, held_out_ids) -> dict:
    """What zeroing every recurrent state costs the model at 1,024 held-out tokens (4 windows,
    10 needles), beside the no-cache floor. The zoo's bar: at least 30% of the floor's KL, or
    at least 0.3 of the native needle recall."""
    from ..evaluation.ablate import AblateConfig, ablate

    length = STATE_BAR["length"]
    zero = "zero every recurrent_state"
    ids = [int(t) for t in held_out_ids]
    rows = {r["label"]: r["lengths"][str(length)] for r in ablate(
        model, lambda s: tok.encode(s).ids, ids,
        AblateConfig([length], windows=4, needles=10, only={"native", "no cache", zero}))}
    share = rows[zero]["kl"] / max(rows["no cache"]["kl"], 1e-9)
    drop = rows["native"]["recall"] - rows[zero]["recall"]
    return {"length": length, "kl_zero_states": round(rows[zero]["kl"], 4),
            "kl_no_cache": round(rows["no cache"]["kl"], 4), "kl_share": round(share, 3),
            "recall_native": rows["native"]["recall"],
            "recall_zero_states": rows[zero]["recall"],
            "meets_bar": share >= STATE_BAR["kl_share"] or drop >= STATE_BAR["recall_drop"]}

