"""`kvtrans audit`: how well each cached object identifies the tokens it holds."""

from __future__ import annotations

import json

import typer

from .common import FitTable, app, in_range, out, progress_bar, user_errors


def _accuracy(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


@app.command()
@user_errors
def audit(model: str = typer.Argument(..., help="zoo alias, model directory, HF id or a llama "
                                                ".gguf file"),
          tokens: int = typer.Option(8192, help="held-out tokens per split: fit on the zoo "
                                                "corpus's validation text, score on its test text"),
          as_json: bool = typer.Option(False, "--json",
                                       help="one JSON entry per layer and object")):
    """Per layer and cache object: top-1 token-identity accuracy of a linear read-out of the
    cached rows (and of codebook decoding for an MLA layer 0)."""
    from mlx_kvtrans.tools.audit import STORAGE_NOTE, held_out_tokens, load_model
    from mlx_kvtrans.tools.audit import audit as run_audit

    in_range("--tokens", tokens, 2)
    lm = load_model(model)
    fit, score = held_out_tokens(lm.tokenizer, tokens)
    with progress_bar("auditing") as progress:
        result = run_audit(lm, fit, score, progress=progress)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    table = FitTable(f"audit {model}  ·  top-1 token identity on held-out text")
    for col in ("object", "kind", "point", "features", "ridge", "nearest mean", "codebook",
                "note"):
        table.add_column(col, right=col not in ("object", "kind", "note"))
    # a note repeats on every layer of its kind: a mark here, its text once under the table
    notes = {n: f"[{i + 1}]" for i, n in enumerate(dict.fromkeys(r.note for r in result.rows
                                                                  if r.note))}
    layer = None
    for row in result.rows:
        if row.layer != layer:  # each layer heads its objects, so 80 columns hold them
            layer = row.layer
            table.add_row(f"layer {row.layer}", row.mixer, style="bold")
        table.add_row(row.object, row.kind, "" if row.point is None else f"({row.point})",
                      f"{row.features:,}", _accuracy(row.readout), _accuracy(row.nearest_mean),
                      _accuracy(row.codebook), notes.get(row.note, ""), style="not bold")
    out.print(table)
    for note, mark in notes.items():
        out.print(f"{mark} {note}", markup=False, highlight=False)
    out.print(f"fitted on {result.fit_tokens:,} validation tokens, scored on "
              f"{result.score_tokens:,} test tokens in windows of {result.window}  ·  one-hot "
              f"over the {result.classes:,} token ids that occur in the fit split (of "
              f"{result.vocab:,})  ·  always the commonest id: {result.majority:.3f}  ·  "
              f"score tokens whose id the fit saw: {result.ceiling:.3f}")
    out.print(f"[bold]{STORAGE_NOTE}[/]")
