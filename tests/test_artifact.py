"""A translator directory that is not exactly what was saved is refused with a message that says
what is wrong: another format version, no SHA256SUMS, a missing file, a modified file."""

import hashlib
import json
import shutil

import mlx.core as mx
import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.fit import fit
from mlx_kvtrans.training.plan import plan

# Both entry points read a directory the same way.
READERS = {"read_manifest": artifact.read_manifest, "load": artifact.load}


@pytest.fixture(scope="module")
def saved(loaded, tmp_path_factory):
    """A tiny qwen3 -> llama translator, fitted and saved once."""
    src, tgt = loaded("qwen3"), loaded("llama")
    specs = plan(kv.layout_of(src.model), kv.layout_of(tgt.model), point=1, nu=2)
    data = [mx.random.randint(0, 259, (2, 32), key=mx.random.key(i)) for i in range(2)]
    tr = fit(src.model, tgt.model, data, specs)
    return artifact.save(tr, tmp_path_factory.mktemp("artifact") / "tr", src, tgt)


@pytest.fixture
def copy(saved, tmp_path):
    """A fresh copy of the saved translator, to break."""
    return shutil.copytree(saved, tmp_path / "tr")


def rewrite_sums(directory):
    """SHA256SUMS matching the directory's files as they are now."""
    names = [line.partition("  ")[2] for line in (directory / "SHA256SUMS").read_text().splitlines()]
    (directory / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256((directory / n).read_bytes()).hexdigest()}  {n}\n" for n in names))


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_an_untouched_artifact_reads_back(copy, read):
    read(copy)  # the control for every refusal below: the same directory, unbroken
    rewrite_sums(copy)  # and the helper that re-hashes writes what save wrote
    read(copy)


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_another_format_version_is_refused(copy, read):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["format_version"] = 999  # a version no library has written
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    rewrite_sums(copy)  # every hash matches: only the version is wrong
    with pytest.raises(KvtransError, match="version") as refused:
        read(copy)
    assert "SHA256SUMS" not in str(refused.value) and "incomplete" not in str(refused.value)


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_missing_sha256sums_is_refused(copy, read):
    (copy / "SHA256SUMS").unlink()
    with pytest.raises(KvtransError, match="no SHA256SUMS"):
        read(copy)


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_missing_weights_file_is_refused_as_incomplete(copy, read):
    (copy / "weights.safetensors").unlink()
    with pytest.raises(KvtransError, match="incomplete: weights.safetensors missing"):
        read(copy)


@pytest.mark.parametrize("name", ["weights.safetensors", "manifest.json"])
@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_a_modified_file_is_refused(copy, read, name):
    data = bytearray((copy / name).read_bytes())
    data[-2] ^= 0x01  # one bit: refused by its hash before anything parses it
    (copy / name).write_bytes(bytes(data))
    with pytest.raises(KvtransError, match=f"{name} does not match SHA256SUMS"):
        read(copy)


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(KvtransError, match="not found"):
        artifact.load(tmp_path / "nowhere")


def test_a_format_1_artifact_loads_as_format_2():
    """tests/data/translator-format1: the manifest of the format-1 kimi-vl -> kimi-linear (map
    and replay objects) with its tensors' names and shapes (zeros: only the layout is read)."""
    from pathlib import Path

    fixture = Path(__file__).parent / "data" / "translator-format1"
    old = json.loads((fixture / "manifest.json").read_text())
    assert old["format_version"] == 1 and "replay_shapes" in old
    tr = artifact.load(fixture)
    assert all(k.startswith("layer") for k in tr.params)
    claimed = set()
    for recipe in tr.recipes:
        own = tr.params_of(recipe)
        claimed |= {f"{recipe.key}.{name}" for name in own}
        if recipe.to_json()["recipe"] == "replay":  # its shapes moved into its entry
            assert recipe.shapes == old["replay_shapes"][f"{recipe.layer}.{recipe.name}"]
        assert own, f"{recipe.key} found none of its parameters"
    assert claimed == set(tr.params)
    assert set(tr.info["metrics"]) == {f"layer{k}" for k in old["metrics"]}
    # each object's entry agrees with its format-1 entry on the fields both formats write
    for entry, recipe in zip(old["objects"], tr.recipes, strict=True):
        now = recipe.to_json()
        assert {k: now[k] for k in entry.keys() & now.keys()} == \
            {k: entry[k] for k in entry.keys() & now.keys()}
        assert {"layer", "name", "recipe", "sources"} <= entry.keys() & now.keys()


def test_a_copy_stored_in_bfloat16_halves_its_matrices_and_translates_alike(saved, loaded,
                                                                            tmp_path):
    src, tgt = loaded("qwen3"), loaded("llama")
    half = artifact.store_as(saved, tmp_path / "half")
    full_bytes = (saved / "weights.safetensors").stat().st_size
    assert (half / "weights.safetensors").stat().st_size < 0.6 * full_bytes
    assert not (half / "frontier.json").exists()
    stored = mx.load(str(half / "weights.safetensors"))
    assert {v.dtype for v in stored.values() if v.ndim >= 2} == {mx.bfloat16}
    assert {v.dtype for v in stored.values() if v.ndim < 2} <= {mx.float32}
    ids = mx.random.randint(0, 259, (1, 24), key=mx.random.key(7))
    objects = []
    for directory in (saved, half):
        tr = artifact.load(directory, src, tgt)
        recorded = kv.capture(src.model, ids, points=tr.source_points())
        objects.append(tr.translate(recorded, tgt.model, kv.layout_of(tgt.model), ids)[0])
    for full, halved in zip(*objects):
        for name, x in full.items():
            assert halved[name].dtype == mx.float32
            scale = float(mx.abs(x).max())
            assert float(mx.abs(halved[name] - x).max()) <= 0.02 * scale, name
