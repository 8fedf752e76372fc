"""Translators: map a source model's cache into a target model's cache format.

    plan.py            which recipe builds each target object, from which source layers
    recipes/           one class per recipe (map, zero, copy, bilinear, replay): what it reads,
                       fits, builds, costs and records
    features.py        per-token source features of a layer at a capture point
    token_identity.py  which token each position holds (ids, or a codebook of layer-0 latents)
    stats.py           streamed second moments and the closed-form ridge solve
    fit.py             stage 1: `FitConfig` and `fit`
    distill.py         stage 2: `DistillConfig`, `Distiller` and `distill` (KL through the target)
    translator.py      `Translator` (translate with any parameters) and `translate_cache`
    artifact.py        the translator directory: save, verified load, format migration
    fidelity.py        how the target continues from a translated cache (KL, agreement, indexer)
    attention_weights.py  attention-weighted fitting (KV-Lingo section 3.2)
"""
