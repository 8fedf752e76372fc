"""Bad input to every option of every `kvtrans` command: exit code 2 and one line on stderr that
names what was wrong, before any heavy work (no fit, no benchmark, no download)."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlx_kvtrans.cli.main import app
from mlx_kvtrans.models import weights_dir
from mlx_kvtrans.translators import artifact

PAIR = artifact.shipped("kimi-linear", "kimi-vl").name  # its models are zoo aliases
REVERSE = artifact.shipped("kimi-vl", "kimi-linear").name
HUGE = "99999999999"

# (arguments, a fragment the message must hold). {name} stands for a path the `paths` fixture
# makes: empty (an empty file), text (a short text file), dir (an empty directory), nowhere,
# truncated (a translator whose weights were cut short, SHA256SUMS recomputed), bad_manifest (a
# translator whose manifest is not JSON, SHA256SUMS recomputed), unfinished (a training workdir
# whose checkpoint has not finished), out (a fresh directory to write into).
CASES = {
    "unknown command": (["bogus"], "bogus"),
    "unknown eval command": (["eval", "bogus"], "bogus"),
    "unknown zoo command": (["zoo", "bogus"], "bogus"),
    # inspect
    "inspect: no model": (["inspect"], "model"),
    "inspect: unknown alias": (["inspect", "no-such-model"], "no-such-model"),
    "inspect: a file": (["inspect", "{empty}"], "is a file"),
    "inspect: an empty directory": (["inspect", "{dir}"], "config.json"),
    "inspect: unknown option": (["inspect", "kimi-vl", "--bogus"], "--bogus"),
    # verify
    "verify: negative prefix": (["verify", "kimi-vl", "--prefix", "-5"], "--prefix"),
    "verify: zero prefix": (["verify", "kimi-vl", "--prefix", "0"], "--prefix"),
    "verify: prefix not a number": (["verify", "kimi-vl", "--prefix", "abc"], "--prefix"),
    "verify: huge prefix": (["verify", "kimi-vl", "--prefix", HUGE], "16,384 positions"),
    "verify: prefix past the positions": (["verify", "kimi-vl", "--prefix", "16380"],
                                          "16,376"),
    "verify: unknown model": (["verify", "{nowhere}"], "not found"),
    # doctor
    "doctor: unknown option": (["doctor", "--bogus"], "--bogus"),
    "doctor: an argument": (["doctor", "extra"], "extra"),
    # plan
    "plan: no --from": (["plan", "--to", "kimi-vl"], "--from"),
    "plan: unknown model": (["plan", "--from", "no-such-model", "--to", "kimi-vl"],
                            "no-such-model"),
    "plan: random layers without random features": (
        ["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--random-layers", "1"],
        "--random-features"),
    "plan: random layer past the target's": (
        ["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--random-features", "8",
         "--random-layers", "9"], "kimi-vl has 4 layers"),
    "plan: empty config file": (["plan", "--from", "{empty}", "--to", "kimi-vl"], "JSON"),
    "plan: capture 0": (["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--capture", "0"],
                        "--capture"),
    "plan: capture 4": (["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--capture", "4"],
                        "--capture"),
    "plan: nu 0": (["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--nu", "0"], "--nu"),
    "plan: nu not a number": (["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--nu", "x"],
                              "--nu"),
    "plan: unknown features": (["plan", "--from", "kimi-linear", "--to", "kimi-vl",
                                "--features", "bogus"], "--features"),
    "plan: negative width": (["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--width",
                              "-1"], "--width"),
    "plan: recipe without =": (["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--recipe",
                                "bilinear"], "--recipe"),
    "plan: recipe of an unknown object": (["plan", "--from", "kimi-linear", "--to", "kimi-vl",
                                           "--recipe", "bogus=bilinear"], "bogus"),
    "plan: unknown recipe": (["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--recipe",
                              "rope_key=bogus"], "bogus"),
    "plan: unknown token identity": (["plan", "--from", "kimi-linear", "--to", "kimi-vl",
                                      "--token-identity", "bogus"], "--token-identity"),
    "plan: zero tokens": (["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--tokens", "0"],
                          "--tokens"),
    # fit (every case passes --data, so none reaches the corpus default)
    "fit: no --out": (["fit", "--from", "kimi-linear", "--to", "kimi-vl"], "--out"),
    "fit: --out a file": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{empty}",
                           "--data", "{text}"], "is a file"),
    "fit: --data missing": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                             "--data", "{nowhere}"], "no such file"),
    "fit: --data empty": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                           "--data", "{empty}"], "empty"),
    "fit: --data a directory without text": (["fit", "--from", "kimi-linear", "--to", "kimi-vl",
                                              "--out", "{out}", "--data", "{dir}"], ".txt"),
    "fit: unknown source": (["fit", "--from", "no-such-model", "--to", "kimi-vl", "--out",
                             "{out}", "--data", "{text}"], "no-such-model"),
    "fit: capture 4": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                        "--capture", "4"], "--capture"),
    "fit: nu 0": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}", "--nu",
                   "0"], "--nu"),
    "fit: unknown features": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out",
                               "{out}", "--features", "bogus"], "--features"),
    "fit: negative width": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                             "--width", "-1"], "--width"),
    "fit: recipe without =": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out",
                               "{out}", "--recipe", "x"], "--recipe"),
    "fit: unknown token identity": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out",
                                     "{out}", "--token-identity", "bogus"], "--token-identity"),
    "fit: point without =": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out",
                              "{out}", "--point", "rope_key"], "--point"),
    "fit: point 7": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                      "--point", "rope_key=7"], "--point"),
    "fit: unknown assign": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                             "--assign", "bogus"], "--assign"),
    "fit: negative attention weighting": (["fit", "--from", "kimi-linear", "--to", "kimi-vl",
                                           "--out", "{out}", "--attention-weighted", "-1"],
                                          "--attention-weighted"),
    "fit: attention weighting over the window": (
        ["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}", "--data", "{text}",
         "--length", "64", "--attention-weighted", "64"], "--attention-weighted"),
    "fit: identity tables without token identity": (
        ["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}", "--data", "{text}",
         "--identity-tables", "8"], "token identity"),
    "fit: negative identity tables": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out",
                                       "{out}", "--identity-tables", "-1"], "--identity-tables"),
    "fit: negative residual": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out",
                                "{out}", "--residual", "-2"], "--residual"),
    "fit: random layers without random features": (
        ["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}", "--random-layers",
         "1"], "--random-features"),
    "fit: random layer past the target's": (
        ["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
         "--random-features", "8", "--random-layers", "1,9"], "kimi-vl has 4 layers"),
    "fit: random layers not integers": (
        ["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
         "--random-features", "8", "--random-layers", "top"], "--random-layers"),
    "fit: replay through the convolution into a target without linear attention": (
        ["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}", "--data", "{text}",
         "--replay-convolve"], "replays no recurrent state"),
    "fit: replay through the convolution of a state the plan copies": (
        ["fit", "--from", "qwen3.5-a", "--to", "qwen3.5-b", "--out", "{out}", "--data", "{text}",
         "--replay-convolve"], "recurrent_state=replay"),
    "fit: replay through the convolution from features after it": (
        ["fit", "--from", "kimi-vl", "--to", "kimi-linear", "--out", "{out}", "--data", "{text}",
         "--capture", "2", "--replay-convolve"], "reads features at raw (capture point 1)"),
    "fit: needle share over 1": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out",
                                  "{out}", "--needle-share", "1.5"], "--needle-share"),
    "fit: zero windows": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                           "--windows", "0"], "--windows"),
    "fit: length 1": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                       "--length", "1"], "--length"),
    "fit: length past the positions": (["fit", "--from", "kimi-linear", "--to", "kimi-vl",
                                        "--out", "{out}", "--data", "{text}", "--length", HUGE],
                                       "16,384 positions"),
    "fit: negative ridge": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                             "--ridge", "-1"], "--ridge"),
    "fit: ridge nan": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                        "--ridge", "nan"], "--ridge"),
    "fit: ridge inf": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                        "--ridge", "inf"], "--ridge"),
    "fit: unknown pooling": (["fit", "--from", "kimi-linear", "--to", "kimi-vl", "--out", "{out}",
                              "--pooling", "max"], "--pooling"),
    "calibrate: no --translator": (["calibrate"], "--translator"),
    "calibrate: translator missing": (["calibrate", "--translator", "{nowhere}"], "not found"),
    "calibrate: zero windows": (["calibrate", "--translator", PAIR, "--windows", "0"],
                                "--windows"),
    "calibrate: needle share over 1": (["calibrate", "--translator", PAIR, "--needle-share",
                                        "1.5"], "--needle-share"),
    "calibrate: needle share nan": (["calibrate", "--translator", PAIR, "--needle-share",
                                     "nan"], "--needle-share"),
    "calibrate: already calibrated": (["calibrate", "--translator", PAIR], "--force"),
    "calibrate: validation missing": (["calibrate", "--translator", PAIR, "--force",
                                       "--validation", "{nowhere}"], "--validation"),
    # distill (cases past the text checks pass --data and --workdir)
    "distill: no --translator": (["distill"], "--translator"),
    "distill: translator missing": (["distill", "--translator", "{nowhere}"], "not found"),
    "distill: translator a file": (["distill", "--translator", "{empty}"], "is a file"),
    "distill: translator an empty directory": (["distill", "--translator", "{dir}"],
                                               "SHA256SUMS"),
    "distill: zero steps": (["distill", "--translator", PAIR, "--steps", "0"], "--steps"),
    "distill: negative attention weight": (["distill", "--translator", PAIR, "--attention-weight",
                                            "-1"], "--attention-weight"),
    "distill: attention weight nan": (["distill", "--translator", PAIR, "--attention-weight",
                                       "nan"], "--attention-weight"),
    "distill: negative output weight": (["distill", "--translator", PAIR, "--output-weight",
                                         "-1"], "--output-weight"),
    "distill: negative object weight": (["distill", "--translator", PAIR, "--object-weight",
                                         "-1"], "--object-weight"),
    "distill: object weight nan": (["distill", "--translator", PAIR, "--object-weight", "nan"],
                                   "--object-weight"),
    "distill: zero batch": (["distill", "--translator", PAIR, "--batch", "0"], "--batch"),
    "distill: negative lr": (["distill", "--translator", PAIR, "--lr", "-1"], "--lr"),
    "distill: lr nan": (["distill", "--translator", PAIR, "--lr", "nan"], "--lr"),
    "distill: negative warmup": (["distill", "--translator", PAIR, "--warmup", "-1"],
                                 "--warmup"),
    "distill: min prefix 1": (["distill", "--translator", PAIR, "--min-prefix", "1"],
                              "--min-prefix"),
    "distill: min prefix over max": (["distill", "--translator", PAIR, "--min-prefix", "300",
                                      "--max-prefix", "200"], "--min-prefix"),
    "distill: max prefix past the positions": (["distill", "--translator", PAIR, "--max-prefix",
                                                HUGE], "16,384 positions"),
    "distill: zero continuation": (["distill", "--translator", PAIR, "--continuation", "0"],
                                   "--continuation"),
    "distill: negative indexer weight": (["distill", "--translator", PAIR, "--indexer-weight",
                                          "-1"], "--indexer-weight"),
    "distill: needle share over 1": (["distill", "--translator", PAIR, "--needle-share", "1.5"],
                                     "--needle-share"),
    "distill: unknown needle form": (["distill", "--translator", PAIR, "--needle-form", "html"],
                                     "--needle-form"),
    "distill: zero validate every": (["distill", "--translator", PAIR, "--validate-every", "0"],
                                     "--validate-every"),
    "distill: zero validation windows": (["distill", "--translator", PAIR,
                                          "--validation-windows", "0"], "--validation-windows"),
    "distill: negative seed": (["distill", "--translator", PAIR, "--seed", "-1"], "--seed"),
    "distill: no such parameters": (["distill", "--translator", PAIR, "--train-only", "nothing",
                                     "--steps", "1", "--out", "/tmp/kvtrans-never"],
                                    "--train-only nothing"),
    "distill: keep what": (["distill", "--translator", PAIR, "--keep", "first"], "--keep"),
    "distill: zero temperature": (["distill", "--translator", PAIR, "--temperature", "0"],
                                  "--temperature"),
    "distill: temperature nan": (["distill", "--translator", PAIR, "--temperature", "nan"],
                                 "--temperature"),
    "distill: zero minutes": (["distill", "--translator", PAIR, "--max-minutes", "0"],
                              "--max-minutes"),
    "distill: minutes nan": (["distill", "--translator", PAIR, "--max-minutes", "nan"],
                             "--max-minutes"),
    "distill: no train text": (["distill", "--translator", PAIR], "--data"),
    "distill: --data empty": (["distill", "--translator", PAIR, "--data", "{empty}"], "empty"),
    "distill: --validation missing": (["distill", "--translator", PAIR, "--data", "{text}",
                                       "--validation", "{nowhere}"], "--validation"),
    "distill: --validation a directory": (["distill", "--translator", PAIR, "--data", "{text}",
                                           "--validation", "{dir}"], "--validation"),
    "distill: --validation empty": (["distill", "--translator", PAIR, "--data", "{text}",
                                     "--validation", "{empty}"], "--validation"),
    "distill: --workdir a file": (["distill", "--translator", PAIR, "--data", "{text}",
                                   "--workdir", "{empty}"], "--workdir"),
    "distill: --out a file": (["distill", "--translator", PAIR, "--data", "{text}", "--workdir",
                               "{out}", "--out", "{empty}"], "--out"),
    # eval needle
    "needle: no model": (["eval", "needle"], "--model"),
    "needle: model and translator": (["eval", "needle", "--model", "kimi-vl", "--translator",
                                      PAIR], "--model"),
    "needle: unknown model": (["eval", "needle", "--model", "no-such-model"], "no-such-model"),
    "needle: zero samples": (["eval", "needle", "--model", "kimi-vl", "--samples", "0"],
                             "--samples"),
    "needle: samples not a number": (["eval", "needle", "--model", "kimi-vl", "--samples", "x"],
                                     "--samples"),
    "needle: negative length": (["eval", "needle", "--model", "kimi-vl", "--lengths", "-5"],
                                "--lengths"),
    "needle: zero length": (["eval", "needle", "--model", "kimi-vl", "--lengths", "0"],
                            "--lengths"),
    "needle: length under a needle": (["eval", "needle", "--model", "kimi-vl", "--lengths",
                                       "256,15"], "--lengths 15"),
    "needle: lengths not numbers": (["eval", "needle", "--model", "kimi-vl", "--lengths",
                                     "256,x"], "--lengths"),
    "needle: length past the positions": (["eval", "needle", "--model", "kimi-vl", "--lengths",
                                           "16385"], "16,384 positions"),
    "needle: translator missing": (["eval", "needle", "--translator", "{nowhere}"], "not found"),
    "needle: unknown format": (["eval", "needle", "--model", "kimi-vl", "--needle-format", "x"],
                               "--needle-format"),
    "needle: facts of text needles": (["eval", "needle", "--model", "kimi-vl", "--facts", "3",
                                       "--needle-format", "text"], "--facts"),
    "needle: zero facts": (["eval", "needle", "--model", "kimi-vl", "--facts", "0"], "--facts"),
    "ablate: unknown needle format": (["eval", "ablate", "--model", "kimi-vl",
                                       "--needle-format", "x"], "--needle-format"),
    "frontier: unknown needle format": (["eval", "frontier", "--translator", PAIR,
                                         "--needle-format", "x"], "--needle-format"),
    # eval perplexity
    "perplexity: no model": (["eval", "perplexity"], "--model"),
    "perplexity: unknown reference": (["eval", "perplexity", "--model", "kimi-vl", "--reference",
                                       "no-such-model"], "no-such-model"),
    "perplexity: length past the positions": (["eval", "perplexity", "--model", "kimi-vl",
                                               "--length", "16385"], "16,384 positions"),
    "perplexity: zero windows": (["eval", "perplexity", "--model", "kimi-vl", "--windows", "0"],
                                 "--windows"),
    "perplexity: text missing": (["eval", "perplexity", "--model", "kimi-vl", "--text",
                                  "{nowhere}"], "no such file"),
    # zoo real
    "zoo real: unknown member": (["zoo", "real", "{out}", "--member", "smollm3"], "smollm3"),
    "zoo real: zero steps": (["zoo", "real", "{out}", "--steps", "0"], "--steps"),
    "zoo real: a file": (["zoo", "real", "{empty}"], "is a file"),
    "needle: truncated translator weights": (["eval", "needle", "--translator", "{truncated}",
                                              "--lengths", "64", "--samples", "1"],
                                             "unreadable"),
    "needle: translator manifest not JSON": (["eval", "needle", "--translator",
                                              "{bad_manifest}", "--lengths", "64"], "manifest"),
    # eval fidelity
    "fidelity: no translator": (["eval", "fidelity"], "--translator"),
    "fidelity: zero prefix": (["eval", "fidelity", "--translator", PAIR, "--prefix-lengths",
                               "0"], "--prefix-lengths"),
    "fidelity: prefix 1": (["eval", "fidelity", "--translator", PAIR, "--prefix-lengths", "1"],
                           "--prefix-lengths"),
    "fidelity: prefix not a number": (["eval", "fidelity", "--translator", PAIR,
                                       "--prefix-lengths", "64,x"], "--prefix-lengths"),
    "fidelity: prefix past the positions": (["eval", "fidelity", "--translator", PAIR,
                                             "--prefix-lengths", "16384"], "16,320"),
    "fidelity: negative sink": (["eval", "fidelity", "--translator", PAIR, "--sink", "-1"],
                                "--sink"),
    "fidelity: zero windows": (["eval", "fidelity", "--translator", PAIR, "--windows", "0"],
                               "--windows"),
    "fidelity: --text missing": (["eval", "fidelity", "--translator", PAIR, "--text",
                                  "{nowhere}"], "--text"),
    "fidelity: --text a directory": (["eval", "fidelity", "--translator", PAIR, "--text",
                                      "{dir}"], "--text"),
    "fidelity: --text empty": (["eval", "fidelity", "--translator", PAIR, "--text", "{empty}"],
                               "--text"),
    "fidelity: unknown --from": (["eval", "fidelity", "--translator", PAIR, "--from",
                                  "no-such-model"], "no-such-model"),
    # eval multiturn
    "multiturn: zero dialogues": (["eval", "multiturn", "--translator", PAIR, "--dialogues",
                                   "0"], "--dialogues"),
    "multiturn: one turn": (["eval", "multiturn", "--translator", PAIR, "--turns", "1"],
                            "--turns"),
    "multiturn: huge turns": (["eval", "multiturn", "--translator", PAIR, "--turns", HUGE],
                              "16,384 positions"),
    "multiturn: dialogues past the positions": (["eval", "multiturn", "--translator", PAIR,
                                                 "--turns", "400", "--dialogues", "1"],
                                                "16,384 positions"),
    "multiturn: --back missing": (["eval", "multiturn", "--translator", PAIR, "--back",
                                   "{nowhere}"], "not found"),
    "multiturn: translator missing": (["eval", "multiturn", "--translator", "{nowhere}"],
                                      "not found"),
    # eval ablate
    "ablate: no model": (["eval", "ablate"], "--model"),
    "ablate: short length": (["eval", "ablate", "--model", "kimi-vl", "--lengths", "5"],
                             "--lengths"),
    "ablate: length past the positions": (["eval", "ablate", "--model", "kimi-vl", "--lengths",
                                           HUGE], "16,384 positions"),
    "ablate: zero windows": (["eval", "ablate", "--model", "kimi-vl", "--windows", "0"],
                             "--windows"),
    "ablate: zero needles": (["eval", "ablate", "--model", "kimi-vl", "--needles", "0"],
                             "--needles"),
    "ablate: --text missing": (["eval", "ablate", "--model", "kimi-vl", "--text", "{nowhere}"],
                               "--text"),
    "ablate: --text empty": (["eval", "ablate", "--model", "kimi-vl", "--text", "{empty}"],
                             "--text"),
    # bench
    "bench: negative length": (["bench", "--lengths=-256"], "--lengths"),
    "bench: zero length": (["bench", "--lengths", "0"], "--lengths"),
    "bench: length 1": (["bench", "--lengths", "1"], "--lengths"),
    "bench: huge length": (["bench", "--lengths", HUGE], "16,384 positions"),
    "bench: length past the positions": (["bench", "--lengths", "1024,65536"],
                                         "16,384 positions"),
    "bench: realistic length past the positions": (["bench", "--realistic", "kimi", "--lengths",
                                                    "200000"], "131,072 positions"),
    "bench: lengths not numbers": (["bench", "--lengths", "1024,x"], "--lengths"),
    "bench: no lengths": (["bench", "--lengths", ","], "--lengths"),
    "bench: zero repeats": (["bench", "--repeats", "0"], "--repeats"),
    "bench: unknown dtype": (["bench", "--dtype", "int8"], "--dtype"),
    "bench: unknown token identity": (["bench", "--token-identity", "bogus"],
                                      "--token-identity"),
    "bench: unknown realistic pair": (["bench", "--realistic", "bogus"], "--realistic"),
    "bench: no translator for the pair": (["bench", "--from", "no-such-model"], "no translator"),
    "bench: translator missing": (["bench", "--translator", "{nowhere}"], "not found"),
    "bench: truncated translator weights": (["bench", "--translator", "{truncated}", "--lengths",
                                             "64", "--repeats", "1"], "unreadable"),
    "bench: translator for other models": (["bench", "--translator", REVERSE,
                                            "--from", "kimi-linear", "--to", "kimi-vl",
                                            "--lengths", "64"], "fitted with"),
    "bench: --out-dir a file": (["bench", "--out-dir", "{empty}"], "--out-dir"),
    # zoo
    "zoo random: unknown family": (["zoo", "random", "bogus", "{out}"], "bogus"),
    "zoo random: no directory": (["zoo", "random", "qwen3"], "OUT_DIR"),
    "zoo random: directory a file": (["zoo", "random", "qwen3", "{empty}"], "is a file"),
    "zoo random: negative seed": (["zoo", "random", "qwen3", "{out}", "--seed", "-1"], "--seed"),
    "zoo random: huge seed": (["zoo", "random", "qwen3", "{out}", "--seed", str(2**64)],
                              "--seed"),
    "zoo random: seed not a number": (["zoo", "random", "qwen3", "{out}", "--seed", "x"],
                                      "--seed"),
    "zoo corpus: --workdir a file": (["zoo", "corpus", "--workdir", "{empty}"], "--workdir"),
    "zoo train: unknown alias": (["zoo", "train", "bogus"], "bogus"),
    "zoo train: zero minutes": (["zoo", "train", "kimi-vl", "--max-minutes", "0"],
                                "--max-minutes"),
    "zoo train: negative minutes": (["zoo", "train", "kimi-vl", "--max-minutes", "-1"],
                                    "--max-minutes"),
    "zoo train: minutes nan": (["zoo", "train", "kimi-vl", "--max-minutes", "nan"],
                               "--max-minutes"),
    "zoo train: zero eval samples": (["zoo", "train", "kimi-vl", "--eval-samples", "0"],
                                     "--eval-samples"),
    "zoo train: --workdir a file": (["zoo", "train", "kimi-vl", "--workdir", "{empty}"],
                                    "--workdir"),
    "zoo ship: unknown alias": (["zoo", "ship", "bogus"], "bogus"),
    "zoo ship: no checkpoint": (["zoo", "ship", "kimi-vl", "--workdir", "{dir}"],
                                "no checkpoint"),
    "zoo ship: unfinished checkpoint": (["zoo", "ship", "kimi-vl", "--workdir", "{unfinished}"],
                                        "steps"),
    "zoo ship: zero samples": (["zoo", "ship", "kimi-vl", "--samples", "0"], "--samples"),
    "zoo list: unknown option": (["zoo", "list", "--bogus"], "--bogus"),
    # nothing already there is replaced without --force
    "zoo random: directory exists": (["zoo", "random", "qwen3", "{dir}"], "--force"),
    "zoo random: --force on a directory not a model's": (["zoo", "random", "qwen3",
                                                          "{truncated}", "--force"],
                                                         "not a model directory"),
    "zoo train: the shipped model": (["zoo", "train", "kimi-vl", "--workdir", "{dir}"],
                                     "--force"),
    "zoo train: --out exists": (["zoo", "train", "kimi-vl", "--workdir", "{dir}", "--out",
                                 "{truncated}"], "--force"),
    "zoo train: --out a file": (["zoo", "train", "kimi-vl", "--workdir", "{dir}", "--out",
                                 "{text}"], "is a file"),
    "zoo train: --out holds the workdir": (["zoo", "train", "kimi-vl", "--workdir", "{dir}",
                                            "--out", "{dir}", "--force"], "of its own"),
    "chat: transcript exists": (["chat", "--transcript", "{text}"], "--force"),
    "chat: transcript in a missing directory": (["chat", "--transcript", "{nowhere}/t.json"],
                                                "no directory"),
    "plan: a fit of years": (["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--tokens",
                              str(10**15)], "years"),
    # chat: the options that fail before the conversation starts
    "chat: unknown strategy": (["chat", "--strategy", "bogus"], "--strategy"),
    "chat: script missing": (["chat", "--script", "{nowhere}"], "--script"),
    "chat: zero max tokens": (["chat", "--max-tokens", "0"], "--max-tokens"),
    "chat: negative sink": (["chat", "--sink", "-1"], "--sink"),
    "chat: unknown model": (["chat", "--from", "no-such-model"], "no-such-model"),
}


def _recompute_sums(directory: Path) -> None:
    names = ("weights.safetensors", "manifest.json")
    (directory / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256((directory / n).read_bytes()).hexdigest()}  {n}\n" for n in names))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    (root / "empty.txt").write_text("")
    (root / "text.txt").write_text("The keeper of the lighthouse wrote every evening.\n" * 20)
    (root / "dir").mkdir()
    shipped = weights_dir() / "translators" / PAIR
    truncated = shutil.copytree(shipped, root / "truncated")
    weights = truncated / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _recompute_sums(truncated)
    bad_manifest = shutil.copytree(shipped, root / "bad_manifest")
    (bad_manifest / "manifest.json").write_text("{not json")
    _recompute_sums(bad_manifest)
    (root / "unfinished" / "kimi-vl").mkdir(parents=True)
    (root / "unfinished" / "kimi-vl" / "state.json").write_text(json.dumps({"step": 0}))
    return {"empty": root / "empty.txt", "text": root / "text.txt", "dir": root / "dir",
            "nowhere": root / "nowhere", "truncated": truncated, "bad_manifest": bad_manifest,
            "unfinished": root / "unfinished", "out": root / "out"}


@pytest.fixture
def in_empty_directory(tmp_path, monkeypatch):
    """Defaults that read ./runs (the corpus, distillation checkpoints) find nothing there."""
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, paths, in_empty_directory):
    args, fragment = CASES[case]
    result = CliRunner().invoke(app, [a.format(**paths) for a in args])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output and "internal error" not in result.output
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert not paths["out"].exists()  # refused before anything was written


def test_kvtrans_alone_prints_the_help(in_empty_directory):
    result = CliRunner().invoke(app, [])
    assert result.exit_code == 2 and "Usage:" in result.output and "bench" in result.output


@pytest.mark.slow  # spawns subprocesses
def test_console_script_refuses_bad_input_on_one_line(tmp_path):
    """The installed entry point, as a user runs it (and as the before-stop hook probes it)."""
    script = Path(sys.executable).parent / "kvtrans"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mlx_kvtrans.cli"]
    for args in (["verify", "kimi-vl", "--prefix", "-5"],
                 ["eval", "needle", "--model", "kimi-vl", "--samples", "0", "--lengths", "256"],
                 ["bench", "--lengths", "0", "--repeats", "1", "--out-dir", str(tmp_path / "o")]):
        proc = subprocess.run(command + args, capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, stdin=subprocess.DEVNULL)
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout
        assert "Usage:" not in proc.stderr


def test_refused_zoo_random_leaves_the_directory_as_it_was(tmp_path):
    """The issue's case: `zoo random` into a model directory replaced it and exited 0."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "kimi_vl"}')
    result = CliRunner().invoke(app, ["zoo", "random", "qwen3", str(model)])
    assert result.exit_code == 2 and "--force" in result.stderr
    assert [p.name for p in model.iterdir()] == ["config.json"]
    assert json.loads((model / "config.json").read_text()) == {"model_type": "kimi_vl"}
    result = CliRunner().invoke(app, ["zoo", "random", "qwen3", str(model), "--force"])
    assert result.exit_code == 0, result.output
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen3"
