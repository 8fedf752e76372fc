"""The ideas `research/ideas.py` measures: each a name, the shipped translator it starts from,
what it does in a few words, and its stage 1 and 2 settings."""

from __future__ import annotations

from dataclasses import dataclass, replace

from frontier import ZOO_LENGTHS
from mlx_kvtrans.training.distill import DistillConfig
from mlx_kvtrans.training.fit import FitConfig

REREAD = 8


@dataclass(frozen=True)
class Idea:
    name: str
    start: str  # the shipped translator it is measured against (and distils, without `fit`)
    what: str  # in a few words, for the table
    config: DistillConfig | None  # None: stage 1 alone (with `fit`)
    fit: FitConfig | None = None  # fit the pair afresh so, then distil
    fit_needle_share: float = 0.0
    stored: str = "float32"  # bfloat16: its matrices are stored so (`artifact.store_as`)


# sequence level and the dial's own tail, on prefixes up to 2x the fitting length
SEQUENCE = dict(steps=500, max_prefix=512, needle_share=0.5, greedy=True, reread=REREAD,
                validation_windows=8)
# the stage 1 and 2 that keep recall into kimi-vl (research/translators.py, EVERY_IDEA)
EVERY_IDEA = FitConfig(point=1, nu=2, features="all", token_identity="ids", attention_weighted=8,
                       identity_tables=32, residual=32)
# kimi-vl -> kimi-linear refitted as shipped, replay predicting the rows before the convolution
CONVOLVED = FitConfig(point=1, nu=2, token_identity="codebook", attention_weighted=8,
                      replay_convolve=True)
IDEAS = [
    Idea("dsa-sequence", "qwen3.5-a__dsa",
         "500 steps on greedy continuations after an 8-token re-read, prefixes 32-512, "
         "half needles", DistillConfig(**SEQUENCE)),
    *[Idea(f"{name.split('__')[0]}-to-{name.split('__')[1].removesuffix('-distilled')}"
           "-sequence", name, "300 steps on greedy continuations after an 8-token re-read, "
           f"prefixes 32-512{', half needles' if share else ''}{f', lr {lr:g}' if lr else ''}",
           DistillConfig(**{**SEQUENCE, "steps": 300, "needle_share": share,
                            **({"lr": lr} if lr else {})}))
      for name, share, lr in [("kimi-vl__kimi-linear-distilled", 0.5, None),
                              ("qwen3-large__qwen3-small-distilled", 0.5, 3e-5),
                              ("qwen3-small__qwen3-large-distilled", 0.5, None),
                              ("qwen3.5-b__qwen3.5-a-distilled", 0.0, 3e-5),
                              ("qwen3.5-a__qwen3.5-b", 0.0, None)]],
    Idea("kimi-vl-to-kimi-linear-long", "kimi-vl__kimi-linear-distilled",
         "2,000 steps on greedy continuations after an 8-token re-read, prefixes 32-2,048, "
         "half needles", DistillConfig(**{**SEQUENCE, "steps": 2000, "max_prefix": 2048})),
    Idea("qwen3.5-b-to-qwen3.5-a-long", "qwen3.5-b__qwen3.5-a-distilled",
         "2,000 steps on greedy continuations after an 8-token re-read, prefixes 32-2,048, "
         "lr 3e-05", DistillConfig(**{**SEQUENCE, "steps": 2000, "max_prefix": 2048,
                                      "needle_share": 0.0, "lr": 3e-5})),
    Idea("qwen3-small-to-qwen3-large-served-lengths", "qwen3-small__qwen3-large-distilled",
         "refit as shipped on 1M tokens in windows of 256-2,048 (a quarter of the tokens "
         "each), then 200 steps as shipped on prefixes 32-1,024",
         DistillConfig(steps=200, attention_weight=1.0, needle_share=0.5, max_prefix=1024),
         replace(EVERY_IDEA, features="attention", windows=4096, length=256,
                 mix=tuple(ZOO_LENGTHS)), 0.5),
    Idea("qwen3-large-to-qwen3-small-served-lengths", "qwen3-large__qwen3-small-distilled",
         "refit as shipped on 1M tokens in windows of 256-2,048, then 200 steps as shipped "
         "on prefixes 32-1,024",
         DistillConfig(steps=200, lr=3e-5, needle_share=0.5, max_prefix=1024),
         FitConfig(point=1, nu=2, token_identity="ids", attention_weighted=8, windows=4096,
                   length=256, mix=tuple(ZOO_LENGTHS)), 0.5),
    Idea("kimi-vl-to-kimi-linear-served-lengths", "kimi-vl__kimi-linear-distilled",
         "refit as shipped on 1M tokens in windows of 256-2,048, then 300 steps on greedy "
         "continuations after an 8-token re-read, prefixes 32-1,024, half needles",
         DistillConfig(**{**SEQUENCE, "steps": 300, "max_prefix": 1024}),
         FitConfig(point=1, nu=2, token_identity="codebook", attention_weighted=8,
                   windows=4096, length=256, mix=tuple(ZOO_LENGTHS)), 0.5),
    Idea("dsa-served-lengths", "qwen3.5-a__dsa-distilled",
         "refit as shipped on 1M tokens in windows of 256-2,048, then 300 steps on greedy "
         "continuations after an 8-token re-read, prefixes 32-1,024, half needles",
         DistillConfig(**{**SEQUENCE, "steps": 300, "max_prefix": 1024}),
         FitConfig(point=1, nu=2, features="all", token_identity="ids", attention_weighted=8,
                   windows=4096, length=256, mix=tuple(ZOO_LENGTHS)), 0.5),
    Idea("dsa-every-idea", "qwen3.5-a__dsa",
         "refit with identity tables and a residual, 200 steps with attention rehearsal",
         DistillConfig(steps=200, attention_weight=1.0, needle_share=0.5), EVERY_IDEA, 0.5),
    Idea("dsa-every-idea-sequence", "qwen3.5-a__dsa",
         "refit with identity tables and a residual, 500 steps with attention rehearsal on "
         "greedy continuations after an 8-token re-read, prefixes 32-512, half needles",
         DistillConfig(**SEQUENCE, attention_weight=1.0), EVERY_IDEA, 0.5),
    *[Idea(f"{name.split('__')[0]}-to-{name.split('__')[1].removesuffix('-distilled')}"
           "-token-identity", name, "refit with token ids, identity tables, attention weights "
           "and states copied, then 300 steps on greedy continuations after an 8-token re-read, "
           f"prefixes 32-512, a quarter needles{f', lr {lr:g}' if lr else ''}",
           DistillConfig(**{**SEQUENCE, "steps": 300, "needle_share": 0.25,
                            **({"lr": lr} if lr else {})}),
           replace(EVERY_IDEA, residual=0), 0.25)
      for name, lr in [("qwen3.5-b__qwen3.5-a-distilled", 3e-5), ("qwen3.5-a__qwen3.5-b", None)]],
    # a nonlinear map in closed form: every source layer and 1,024 random features of them
    # (research/results/capacity.md), stage 2 as shipped
    Idea("qwen3-large-to-qwen3-small-random-features", "qwen3-large__qwen3-small-distilled",
         "refit with every source layer, token ids and 1,024 random features, needle-weighted, "
         "then 200 steps as shipped", DistillConfig(steps=200, lr=3e-5, needle_share=0.5),
         FitConfig(point=1, nu=5, token_identity="ids", attention_weighted=8,
                   random_features=1024), 0.5),
    Idea("qwen3-large-to-qwen3-small-random-features-stage1", "qwen3-large__qwen3-small-distilled",
         "the same fit, not distilled", None,
         FitConfig(point=1, nu=5, token_identity="ids", attention_weighted=8,
                   random_features=1024), 0.5),
    Idea("qwen3-large-to-qwen3-small-random-features-gentle", "qwen3-large__qwen3-small-distilled",
         "the same fit, then 200 steps at a third of the shipped rate (lr 1e-05)",
         DistillConfig(steps=200, lr=1e-5, needle_share=0.5),
         FitConfig(point=1, nu=5, token_identity="ids", attention_weighted=8,
                   random_features=1024), 0.5),
    Idea("qwen3-large-to-qwen3-small-random-features-4096-stage1",
         "qwen3-large__qwen3-small-distilled",
         "refit with every source layer, token ids, identity tables and 4,096 random features, "
         "needle-weighted, not distilled", None,
         FitConfig(point=1, nu=5, token_identity="ids", attention_weighted=8, identity_tables=32,
                   random_features=4096), 0.5),
    # per-layer supervision: each token mixer's output held to the one it gives reading the
    # target's own cache (Heo et al.), beside as many more steps without it
    *[Idea(f"{short}-{tag}", start, f"200 steps more as shipped{how}{what}",
           replace(config, output_weight=weight))
      for short, start, how, config in [
          ("qwen3-small-to-qwen3-large", "qwen3-small__qwen3-large-distilled",
           ", prefixes 32-512",
           DistillConfig(steps=200, attention_weight=1.0, needle_share=0.5, max_prefix=512)),
          ("kimi-vl-to-kimi-linear", "kimi-vl__kimi-linear-distilled",
           " (greedy continuations after an 8-token re-read, prefixes 32-512, half needles)",
           DistillConfig(**{**SEQUENCE, "steps": 200}))]
      for tag, what, weight in [("more-steps", "", 0.0),
                                ("outputs", ", with the output rehearsal (weight 1)", 1.0)]],
    *[Idea(f"{short}-outputs", start, f"200 steps more as shipped{how}, with the output "
           "rehearsal (weight 1)", replace(config, output_weight=1.0))
      for short, start, how, config in [
          ("dsa", "qwen3.5-a__dsa-distilled", " (greedy continuations after an 8-token "
           "re-read, prefixes 32-512, half needles)", DistillConfig(**{**SEQUENCE, "steps": 200})),
          ("qwen3.5-b-to-qwen3.5-a", "qwen3.5-b__qwen3.5-a-distilled", " (greedy "
           "continuations after an 8-token re-read, prefixes 32-512, lr 3e-05)",
           DistillConfig(**{**SEQUENCE, "steps": 200, "needle_share": 0.0, "lr": 3e-5})),
          ("qwen3-large-to-qwen3-small", "qwen3-large__qwen3-small-distilled",
           " (prefixes 32-256, half needles, lr 3e-05)",
           DistillConfig(steps=200, lr=3e-5, needle_share=0.5)),
          ("qwen3.5-a-to-qwen3.5-b", "qwen3.5-a__qwen3.5-b", " (the stage-1 translator "
           "shipped; greedy continuations after an 8-token re-read, prefixes 32-512)",
           DistillConfig(**{**SEQUENCE, "steps": 200, "needle_share": 0.0}))]],
    # a second round where the rehearsal was kept (from the translators it made), heavier where
    # it helped most, and lighter where weight 1 traded 512 tokens for 256
    *[Idea(f"{short}-{tag}", start, f"200 steps more as shipped{how}, with the output "
           f"rehearsal (weight {weight:g})", replace(config, output_weight=weight))
      for short, start, how, config, tag, weight in [
          ("kimi-vl-to-kimi-linear", "kimi-vl__kimi-linear-distilled", " (itself rehearsed; "
           "greedy continuations after an 8-token re-read, prefixes 32-512, half needles)",
           DistillConfig(**{**SEQUENCE, "steps": 200}), "outputs-again", 1.0),
          ("kimi-vl-to-kimi-linear", "kimi-vl__kimi-linear-distilled", " (itself rehearsed; "
           "greedy continuations after an 8-token re-read, prefixes 32-512, half needles)",
           DistillConfig(**{**SEQUENCE, "steps": 200}), "outputs-heavy", 4.0),
          ("dsa", "qwen3.5-a__dsa-distilled", " (itself rehearsed; greedy continuations after "
           "an 8-token re-read, prefixes 32-512, half needles)",
           DistillConfig(**{**SEQUENCE, "steps": 200}), "outputs-again", 1.0),
          ("qwen3-small-to-qwen3-large", "qwen3-small__qwen3-large-distilled",
           ", prefixes 32-512", DistillConfig(steps=200, attention_weight=1.0,
                                              needle_share=0.5, max_prefix=512),
           "outputs-light", 0.25),
          ("qwen3-large-to-qwen3-small", "qwen3-large__qwen3-small-distilled",
           " (prefixes 32-256, half needles, lr 3e-05)",
           DistillConfig(steps=200, lr=3e-5, needle_share=0.5), "outputs-light", 0.25)]],
    # capacity where the translation loses most: random features for the maps of the target
    # layers whose translation alone costs the most history (research/results/layers.md)
    *[Idea(f"qwen3-large-to-qwen3-small-random-features-{width}-layers-{tag}",
           "qwen3-large__qwen3-small-distilled",
           f"refit with every source layer, token ids and {width:,} random features for "
           f"target layer{'s' if len(layers) > 1 else ''} {' and '.join(map(str, layers))}, "
           "needle-weighted, not distilled", None,
           FitConfig(point=1, nu=5, token_identity="ids", attention_weighted=8,
                     random_features=width, random_layers=layers), 0.5)
      for width, layers, tag in [(2048, (2, 3), "2-3"), (1024, (2,), "2")]],
    Idea("qwen3-large-to-qwen3-small-random-features-2048-layers-2-3-nearest",
         "qwen3-large__qwen3-small-distilled",
         "refit as shipped (the two nearest source layers, token ids, attention-weighted) with "
         "2,048 random features for target layers 2 and 3, needle-weighted, not distilled", None,
         FitConfig(point=1, nu=2, token_identity="ids", attention_weighted=8,
                   random_features=2048, random_layers=(2, 3)), 0.5),
    Idea("dsa-random-features-2048-layers-2-3", "qwen3.5-a__dsa-distilled",
         "refit as shipped (every source layer, token ids, attention-weighted) with 2,048 "
         "random features for target layers 2 and 3, needle-weighted, then 500 steps on greedy "
         "continuations after an 8-token re-read, prefixes 32-512, half needles, with the "
         "output rehearsal (weight 1); its matrices stored in bfloat16",
         DistillConfig(**{**SEQUENCE, "output_weight": 1.0}),
         FitConfig(point=1, nu=2, features="all", token_identity="ids", attention_weighted=8,
                   random_features=2048, random_layers=(2, 3)), 0.5, stored="bfloat16"),
    Idea("dsa-random-features-512-layers-2-3", "qwen3.5-a__dsa-distilled",
         "the same with 512 random features: does the recall hold at a quarter of the width",
         DistillConfig(**{**SEQUENCE, "output_weight": 1.0}),
         FitConfig(point=1, nu=2, features="all", token_identity="ids", attention_weighted=8,
                   random_features=512, random_layers=(2, 3)), 0.5, stored="bfloat16"),
    # the ablation puts the direction's lost needles in target layer 2's latent
    # (`kvtrans eval ablate --translator qwen3.5-a__dsa-distilled`): width there alone
    Idea("dsa-random-features-2048-layer-2", "qwen3.5-a__dsa-distilled",
         "the 2,048-feature run with the features for target layer 2 alone, where the "
         "ablation loses the needles", DistillConfig(**{**SEQUENCE, "output_weight": 1.0}),
         FitConfig(point=1, nu=2, features="all", token_identity="ids", attention_weighted=8,
                   random_features=2048, random_layers=(2,)), 0.5, stored="bfloat16"),
    Idea("dsa-refit-outputs", "qwen3.5-a__dsa-distilled",
         "refit as shipped (every source layer, token ids, attention-weighted), needle-weighted, "
         "then 500 steps on greedy continuations after an 8-token re-read, prefixes 32-512, "
         "half needles, with the output rehearsal (weight 1): the random-feature run without "
         "its features", DistillConfig(**{**SEQUENCE, "output_weight": 1.0}),
         FitConfig(point=1, nu=2, features="all", token_identity="ids", attention_weighted=8),
         0.5),
    Idea("qwen3-large-to-qwen3-small-residual-objects", "qwen3-large__qwen3-small-distilled",
         "refit as shipped with a residual of 64 hidden units per map, needle-weighted, then 400 "
         "steps (lr 1e-4, prefixes 32-256, half needles) holding each map's objects to the "
         "target's own (object rehearsal, weight 1) beside the KL: a learned nonlinear map",
         DistillConfig(steps=400, max_prefix=256, needle_share=0.5, object_weight=1.0,
                       validation_windows=8),
         FitConfig(point=1, nu=2, token_identity="ids", attention_weighted=8, residual=64), 0.5),
    Idea("qwen3-large-to-qwen3-small-residual-objects-lr-1e-3",
         "qwen3-large__qwen3-small-distilled",
         "the same with lr 1e-3 (the object rehearsal fell by a tenth in 400 steps at 1e-4)",
         DistillConfig(steps=400, lr=1e-3, max_prefix=256, needle_share=0.5, object_weight=1.0,
                       validation_windows=8),
         FitConfig(point=1, nu=2, token_identity="ids", attention_weighted=8, residual=64), 0.5),
    Idea("qwen3-large-to-qwen3-small-random-features-2048-layers-2-3-nearest-bfloat16",
         "qwen3-large__qwen3-small-distilled",
         "refit as shipped (the two nearest source layers, token ids, attention-weighted) with "
         "2,048 random features for target layers 2 and 3, needle-weighted, not distilled; "
         "its matrices stored in bfloat16", None,
         FitConfig(point=1, nu=2, token_identity="ids", attention_weighted=8,
                   random_features=2048, random_layers=(2, 3)), 0.5, stored="bfloat16"),
    *[Idea(f"qwen3.5-a-to-qwen3.5-b-random-features-{width}-layer-3",
           "qwen3.5-a__qwen3.5-b-distilled",
           f"refit as shipped with {width:,} random features for target layer 3 (its "
           "attention), then 200 steps as shipped (greedy continuations after an 8-token "
           "re-read, prefixes 32-512, output rehearsal)",
           DistillConfig(**{**SEQUENCE, "steps": 200, "needle_share": 0.0,
                            "output_weight": 1.0}),
           FitConfig(point=1, features="all", recipes={"recurrent_state": "bilinear"},
                     random_features=width, random_layers=(3,)))
      for width in (2048,)],
    Idea("kimi-vl-to-kimi-linear-random-features-stage1", "kimi-vl__kimi-linear-distilled",
         "refit as shipped with every source layer and 1,024 random features, not distilled",
         None, FitConfig(point=1, nu=6, token_identity="codebook", attention_weighted=8,
                         random_features=1024), 0.5),
    # the loss aimed at the ordering of the top tokens: a switch's disagreements with native
    # sit where native's top two tokens are nearly tied; each with its control at temperature 1
    *[Idea(f"{name.split('__')[0]}-to-{name.split('__')[1].removesuffix('-distilled')}"
           f"-temperature-{t:g}", name,
           f"300 steps on greedy continuations after an 8-token re-read, prefixes 32-512, half "
           f"needles, KL at temperature {t:g}", DistillConfig(**{**SEQUENCE, "steps": 300,
                                                                "temperature": t}))
      for name in ("qwen3-large__qwen3-small-distilled",) for t in (0.25, 1.0)],
    # width where qwen3-large's history is lost (its last two layers, layers.md), as the width
    # kept for the reverse direction: the shipped fit's features and tables, stage 1 alone
    Idea("qwen3-small-to-qwen3-large-random-features-2048-layers-3-4-bfloat16",
         "qwen3-small__qwen3-large-distilled",
         "refit as shipped (the two nearest source layers, token ids, rank-32 identity tables, "
         "attention-weighted) with 2,048 random features for target layers 3 and 4, "
         "needle-weighted, not distilled; its matrices stored in bfloat16", None,
         FitConfig(point=1, nu=2, token_identity="ids", attention_weighted=8,
                   identity_tables=32, random_features=2048, random_layers=(3, 4)), 0.5,
         stored="bfloat16"),
    # the recurrence inputs a token-wise map fits worst are the convolved ones (each mixes K
    # tokens): replay predicts the rows before the target's own short convolution instead
    Idea("kimi-vl-to-kimi-linear-convolved-stage1", "kimi-vl__kimi-linear-distilled",
         "refit as shipped (codebook, attention-weighted, needle-weighted), replay's k and v "
         "predicted before the target's short convolution and passed through it, not distilled",
         None, CONVOLVED, 0.5),
    Idea("kimi-vl-to-kimi-linear-convolved", "kimi-vl__kimi-linear-distilled",
         "the same, then 300 steps on greedy continuations after an 8-token re-read, prefixes "
         "32-512, half needles, with the output rehearsal (weight 1)",
         DistillConfig(**{**SEQUENCE, "steps": 300, "output_weight": 1.0}),
         CONVOLVED, 0.5),
    Idea("kimi-vl-to-kimi-linear-convolved-500", "kimi-vl__kimi-linear-distilled",
         "the same fit, then 500 steps (as many as the shipped translator's two runs) on "
         "greedy continuations after an 8-token re-read, prefixes 32-512, half needles, with "
         "the output rehearsal (weight 1)",
         DistillConfig(**{**SEQUENCE, "output_weight": 1.0}),
         CONVOLVED, 0.5),
    # what keeps recall into kimi-vl (EVERY_IDEA), in the other direction
    Idea("kimi-vl-to-kimi-linear-every-idea", "kimi-vl__kimi-linear-distilled",
         "refit with every source layer, token ids, identity tables and a residual, "
         "needle-weighted, then 500 steps on greedy continuations after an 8-token re-read, "
         "prefixes 32-512, half needles, with the output rehearsal (weight 1)",
         DistillConfig(**{**SEQUENCE, "output_weight": 1.0}), EVERY_IDEA, 0.5),
    # a learned nonlinear map that cannot unlearn the closed form: only the residual trains
    Idea("qwen3-large-to-qwen3-small-residual-alone", "qwen3-large__qwen3-small-distilled",
         "refit as shipped with a residual of 128 hidden units per map, needle-weighted, then "
         "600 steps training the residual alone (lr 1e-3, prefixes 32-256, half needles) on "
         "the KL and the object rehearsal (weight 1)",
         DistillConfig(steps=600, lr=1e-3, max_prefix=256, needle_share=0.5, object_weight=1.0,
                       train_only="residual", validation_windows=8),
         FitConfig(point=1, nu=2, token_identity="ids", attention_weighted=8, residual=128),
         0.5),
]
