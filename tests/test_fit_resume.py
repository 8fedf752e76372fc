"""A long fit survives Ctrl-C and a crash: resumed from its checkpoint, it ends with the
translator an unbroken fit makes."""

import os
import signal

import mlx.core as mx
import pytest

from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.training.fit import FitConfig, fit
from mlx_kvtrans.training.fit_checkpoint import FILE, FitCheckpoint

CONFIG = FitConfig(token_identity="ids", attention_weighted=4, identity_tables=4)


@pytest.fixture(scope="module")
def pair(loaded):
    return loaded("kimi_vl"), loaded("kimi_linear")  # maps, KDA replay and state sums


def batches():
    return [mx.random.randint(0, 259, (2, 32), key=mx.random.key(i)) for i in range(6)]


def max_difference(a, b) -> float:
    assert a.params.keys() == b.params.keys()
    return max(float(mx.max(mx.abs(a.params[k].astype(mx.float32)
                                   - b.params[k].astype(mx.float32)))) for k in a.params)


def test_a_fit_stopped_by_ctrl_c_resumes_to_the_same_translator(pair, tmp_path):
    src, tgt = pair
    whole = fit(src.model, tgt.model, batches(), config=CONFIG)

    def press_ctrl_c(done, tokens):
        if done == 3:  # half-way: the signal arrives while the fit runs
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        fit(src.model, tgt.model, batches(), config=CONFIG, progress=press_ctrl_c,
            checkpoint=FitCheckpoint(tmp_path, every_seconds=1e9))
    assert (tmp_path / FILE).is_file()  # written when Ctrl-C was pressed, not on a timer
    seen = []
    resumed = fit(src.model, tgt.model, batches(), config=CONFIG,
                  progress=lambda done, tokens: seen.append(done),
                  checkpoint=FitCheckpoint(tmp_path, resume=True))
    assert seen == [4, 5, 6]  # only the batches not summed before
    assert max_difference(whole, resumed) <= 1e-5
    assert resumed.info["fit"]["tokens"] == whole.info["fit"]["tokens"]
    assert resumed.info["fit"]["data_sha256"] == whole.info["fit"]["data_sha256"]


def test_a_fit_that_crashed_resumes_from_its_last_checkpoint(pair, tmp_path):
    src, tgt = pair
    whole = fit(src.model, tgt.model, batches(), config=CONFIG)

    def crash(done, tokens):
        if done == 4:
            raise RuntimeError("the machine went down")

    with pytest.raises(RuntimeError):
        fit(src.model, tgt.model, batches(), config=CONFIG, progress=crash,
            checkpoint=FitCheckpoint(tmp_path, every_seconds=0))
    resumed = fit(src.model, tgt.model, batches(), config=CONFIG,
                  checkpoint=FitCheckpoint(tmp_path, resume=True))
    assert max_difference(whole, resumed) <= 1e-5


def test_a_checkpoint_continues_only_its_own_fit(pair, tmp_path):
    src, tgt = pair
    fit(src.model, tgt.model, batches()[:2], config=CONFIG,
        checkpoint=FitCheckpoint(tmp_path, every_seconds=0))
    with pytest.raises(KvtransError, match="another fit"):
        fit(src.model, tgt.model, batches()[:3], config=CONFIG,
            checkpoint=FitCheckpoint(tmp_path, resume=True))
    with pytest.raises(KvtransError, match="--resume"):
        fit(src.model, tgt.model, batches()[:2], config=CONFIG,
            checkpoint=FitCheckpoint(tmp_path))


def test_a_checkpoint_file_cannot_run_code(pair, tmp_path):
    """A checkpoint is a pickle of the fit's sums; one that names anything else (here a shell
    command) is refused as unreadable before it runs."""
    import pickle

    src, tgt = pair

    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    (tmp_path / "w").mkdir()
    (tmp_path / "w" / FILE).write_bytes(pickle.dumps({"key": "x", "payload": Hostile()}))
    with pytest.raises(KvtransError, match="unreadable"):
        fit(src.model, tgt.model, batches(), config=CONFIG,
            checkpoint=FitCheckpoint(tmp_path / "w", resume=True))
    assert not (tmp_path / "ran").exists()
    (tmp_path / "w" / FILE).write_bytes(pickle.dumps([1, 2, 3]))  # not a checkpoint's shape
    with pytest.raises(KvtransError, match="another fit"):
        fit(src.model, tgt.model, batches(), config=CONFIG,
            checkpoint=FitCheckpoint(tmp_path / "w", resume=True))


def test_cli_fit_resume_refusals_name_the_workdir(model_dirs, tmp_path):
    from typer.testing import CliRunner

    from mlx_kvtrans.cli.main import app

    text = tmp_path / "text.txt"
    text.write_text("A short passage about ships, harbours and the weather at sea. " * 80)
    base = ["fit", "--from", str(model_dirs("kimi_linear")), "--to", str(model_dirs("kimi_vl")),
            "--data", str(text), "--windows", "8", "--length", "48", "--gate-windows", "1",
            "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "tr")]
    runner = CliRunner()
    nothing = runner.invoke(app, base + ["--resume"])
    assert nothing.exit_code == 2 and "holds no fit checkpoint" in nothing.output
    done = runner.invoke(app, base)
    assert done.exit_code == 0, done.output
    assert not (tmp_path / "w" / FILE).exists()  # the translator is saved: its sums go
    (tmp_path / "w").mkdir(exist_ok=True)
    (tmp_path / "w" / FILE).write_bytes(b"left by a stopped fit")
    held = runner.invoke(app, base[:-2] + ["--out", str(tmp_path / "tr2")])
    assert held.exit_code == 2 and "pass --resume" in held.output
    garbled = runner.invoke(app, base[:-2] + ["--out", str(tmp_path / "tr2"), "--resume"])
    assert garbled.exit_code == 2 and "unreadable" in garbled.output
    assert not (tmp_path / "tr2").exists()


def test_a_saved_fit_leaves_no_empty_folders_of_its_checkpoint(pair, tmp_path):
    src, tgt = pair
    (tmp_path / "kept").mkdir()
    checkpoint = FitCheckpoint(tmp_path / "runs" / "fit" / "tr", every_seconds=0)
    fit(src.model, tgt.model, batches()[:2], config=CONFIG, checkpoint=checkpoint)
    assert (tmp_path / "runs" / "fit" / "tr" / FILE).is_file()
    checkpoint.clear()  # as `fit_translator` does once the translator is saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
