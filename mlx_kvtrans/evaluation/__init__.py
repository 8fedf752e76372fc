"""Held-out evaluation tasks and their scoring.

- `tasks`: seeded generators of needles, key-value recall and multi-turn dialogues;
- `needles`: the held-out needle filler, needle prompts, exact recall and answer-digit loss, and
  the distillation needle rows (seeds below the held-out ones);
- `perplexity`: held-out perplexity beside a unigram baseline;
- `multiturn`: held-out dialogues that alternate models at every turn;
- `behaviour`: how a target's answers change when it continues from a translated cache (first
  token, length, leading space, refusals, copied numbers, repetition), with bootstrap intervals.

Used by the zoo's training (figures of each model) and by the translators' evaluation. Nothing is
imported here, so importing the package stays cheap.
"""
