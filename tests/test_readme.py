"""README is short, its two commands are what CI runs, its Python example really runs on the
shipped zoo (offline) and says what it should, and its results table is what the results files
hold now."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
DOC_BLOCKS = [(page.name, block) for page in sorted((ROOT / "docs").glob("*.md"))
              for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
MAX_LINES = 250


def load_summary():
    spec = importlib.util.spec_from_file_location("summary", ROOT / "benchmarks" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_code_block() -> list[str]:
    match = re.search(r"```[a-z]*\n(.*?)```", README, re.S)
    assert match, "README has no code block"
    return [line for line in match.group(1).splitlines() if line.strip()]


def test_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= MAX_LINES


def test_readme_opens_with_title_paragraph_and_two_commands():
    lines = README.splitlines()
    assert lines[0].startswith("# ")
    first_block = README.index("```")
    paragraph = README[len(lines[0]):first_block].strip()
    assert paragraph and "#" not in paragraph  # a paragraph, no section before the commands
    commands = first_code_block()
    assert len(commands) == 2
    assert commands[1] == "./setup.sh && .venv/bin/python -m pytest -q"  # what .ci/run runs
    assert "kvtrans chat" in commands[0]


def test_ci_runs_the_second_command():
    """.ci/run takes the second line of README's first code block."""
    awk = subprocess.run(["bash", "-c", "awk '/^```/{block++; next} block == 1' README.md "
                          "| sed -n 2p"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert awk.stdout.strip() == first_code_block()[1]


def test_readme_results_table_is_what_the_results_files_hold():
    summary = load_summary()
    block = summary.current_block(README)
    assert block is not None, "README has no results block"
    assert block == summary.render(), "stale: run python benchmarks/summary.py"


def test_summary_check_exits_1_on_a_stale_block(tmp_path):
    summary = load_summary()
    stale = tmp_path / "README.md"
    stale.write_text(README.replace(summary.current_block(README),
                                    f"{summary.BEGIN}\n| old |\n{summary.END}"))
    assert summary.main(["--check", "--readme", str(stale)]) == 1
    assert summary.main(["--readme", str(stale)]) == 0  # rewrites it
    assert summary.main(["--check", "--readme", str(stale)]) == 0
    assert stale.read_text() == README


def test_summary_rows_are_the_shipped_translators():
    """One row per shipped direction, named as its directory under weights/translators/; the
    real family's rows (built, not shipped) follow in a table of their own."""
    from mlx_kvtrans.models import weights_dir

    shipped = {p.name for p in (weights_dir() / "translators").iterdir() if p.is_dir()}
    zoo_table = load_summary().render().split("| real translator (built)")[0]
    rows = re.findall(r"^\| `([^`]+)` \|", zoo_table, re.M)
    assert set(rows) == shipped


def test_readme_has_one_python_example():
    assert len(BLOCKS) == 1
    assert len(BLOCKS[0].splitlines()) <= 30


def test_readme_python_example_hands_a_needle_over(capsys):
    """Run as written: kimi-vl, reading only kimi-linear's translated cache, names the number."""
    exec(compile(BLOCKS[0], "README.md python example", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out
    assert "<|" not in printed  # no raw special tokens such as <|im_end|>
    lines = dict(line.split(":", 1) for line in printed.splitlines() if ":" in line)
    assert "552190" in lines["kimi-vl"]
    assert re.search(r"^applied passed \d+ tokens translated$", printed, re.M)


@pytest.mark.parametrize("index", range(len(DOC_BLOCKS)))
def test_docs_python_examples_run(index, capsys):
    name, block = DOC_BLOCKS[index]
    exec(compile(block, f"docs/{name} python example", "exec"), {"__name__": "docs"})


@pytest.mark.parametrize("doc", ["zoo", "recipes", "serving", "results", "negative-results"])
def test_readme_links_resolve(doc):
    assert f"(docs/{doc}.md)" in README
    assert (ROOT / "docs" / f"{doc}.md").is_file()


def test_docs_links_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_documented_headers_are_the_servers():
    """Every x-kvtrans-* header README or docs name is one the server sends or reads."""
    source = "".join(p.read_text() for p in (ROOT / "mlx_kvtrans" / "serve").glob("*.py"))
    pages = [README, *(p.read_text() for p in (ROOT / "docs").glob("*.md"))]
    named = {h.lower() for page in pages for h in re.findall(r"x-kvtrans-[a-zA-Z][a-zA-Z-]*", page)}
    assert "x-kvtrans-history" in named
    for header in sorted(named):
        assert f'"{header}"' in source, f"{header} is not a header of kvtrans serve"


@pytest.mark.parametrize("folder", ["benchmarks", "research"])
def test_results_index_names_every_results_file(folder):
    index = (ROOT / "docs" / "results.md").read_text()
    section = index[index.index(f"`{folder}/`"):]
    section = section[:section.index("\n## ")] if "\n## " in section else section
    results = ROOT / folder / "results"
    stems = {re.sub(r"-(float32|bfloat16)$", "", p.stem) for p in results.glob("*.json")}
    stems |= {p.stem for p in results.glob("*.md")}
    for stem in sorted(stems):
        name = "bench-*" if stem.startswith("bench-") else stem
        assert name in section, f"docs/results.md does not index {folder}/results/{stem}"


def test_benchmarks_hold_at_most_ten_scripts_each_runnable_from_the_root():
    scripts = [p for p in (ROOT / "benchmarks").glob("*.py")
               if '__name__ == "__main__"' in p.read_text()]
    assert len(scripts) <= 10, sorted(p.name for p in scripts)
    # in one process, as `python benchmarks/NAME.py --help` runs each from the root: the
    # script's folder first on the path, the package imported once for all
    check = ("import runpy, sys\nfailed = []\nfor path in sys.argv[1:]:\n"
             "    sys.argv = [path, '--help']\n    sys.path.insert(0, path.rsplit('/', 1)[0])\n"
             "    try:\n        runpy.run_path(path, run_name='__main__')\n"
             "    except SystemExit as e:\n        failed += [path] if e.code else []\n"
             "    except Exception as e:\n        failed.append(f'{path}: {e!r}')\n"
             "    sys.path.pop(0)\nprint(failed)\nsys.exit(1 if failed else 0)\n")
    run = subprocess.run([sys.executable, "-c", check,
                          *(str(p.relative_to(ROOT)) for p in scripts)],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-500:] + run.stderr[-500:]


def test_real_checkpoints_doc_shows_what_its_results_file_holds():
    """docs/real-checkpoints.md's and docs/distributed.md's figures are the blocks
    `benchmarks/real_checkpoints.py` renders from `real-checkpoints.json`, not typed by hand."""
    import json

    spec = importlib.util.spec_from_file_location(
        "real_checkpoints", ROOT / "benchmarks" / "real_checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    recorded = json.loads((ROOT / "benchmarks" / "results" / "real-checkpoints.json").read_text())
    from mlx_kvtrans.training.machines import Machine

    for page, table in (("real-checkpoints.md", module.markdown(
            recorded["rows"], Machine(**recorded["machine"]))),
            ("distributed.md", module.link_markdown(recorded["rows"]))):
        doc = (ROOT / "docs" / page).read_text()
        assert f"{module.BEGIN}\n{table}{module.END}" in doc, page


def test_the_glossarys_retired_words_appear_nowhere():
    """docs/glossary.md retires words; none is in the package, the CLI (its help included),
    README or the other docs."""
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    rows = [line.split("|") for line in glossary.splitlines() if line.startswith("| **")]
    retired = {w.strip() for row in rows for w in row[4].split(",") if w.strip()}
    assert {"handoff", "hand-over", "re-prefill", "reprefill"} <= retired
    words = [re.sub(r" \(for this\)| in prose", "", w) for w in retired]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "mlx_kvtrans").rglob("*.py")), *sorted((ROOT / "cli").glob("*.py"))]
    for page in pages:
        if page.name == "glossary.md":
            continue
        text = page.read_text()
        for word in words:
            if word == "prepare":  # a translator's `prepare` is another idea
                continue
            # "(1)" as prose names a capture point; `cap.at(1)` is a call
            pattern = rf"(?<![\w.]){re.escape(word)}" if word.startswith("(") \
                else rf"\b{re.escape(word)}\b"
            found = re.search(pattern, text, flags=re.IGNORECASE)
            assert not found, f"{page.relative_to(ROOT)} uses the retired word {word!r}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
