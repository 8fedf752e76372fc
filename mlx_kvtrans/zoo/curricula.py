"""The curriculum of every zoo model: architecture, seed, data mix and schedule.

(A "recipe" is how a translator builds a target object; a zoo model is trained from a
"curriculum".) `kvtrans zoo train ALIAS` reproduces a model from its curriculum. Sizes follow what trains in under
an hour on a 2-core CPU (float32): hidden 128-192, 4-6 layers, tied embeddings, 4K vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .data import Mix

VOCAB = 4096
# weights/NAME/ -> vocabulary size. "tokenizer" is the one the zoo shares; "tokenizer-xt",
# trained alike with fewer entries, keeps fewer of nearly the same merges, so it splits some of
# the same text into more tokens: a pair that translates across tokenizers.
TOKENIZERS = {"tokenizer": VOCAB, "tokenizer-xt": 3072}

_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=64,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, rope_theta=10000.0,
            n_routed_experts=4, n_shared_experts=1)


@dataclass
class Curriculum:
    alias: str
    family: str  # mlx-lm model_type
    role: str
    config: dict  # config.json fields (vocab and special-token ids are added)
    seed: int
    steps: int
    batch: int = 8
    length: int = 256  # the longest training prompt, in tokens
    # 3e-3 left these models unable to learn even a pure copy task (loss stuck at chance);
    # 1e-3 learns it (measured with the same configs on random-token copies).
    lr: float = 1e-3
    warmup: int = 100
    mix: Mix = field(default_factory=Mix)
    init_from: str | None = None  # continue training this alias (a "next generation")
    dense_warmup: float = 0.0  # DSA: share of steps with dense attention while the indexer learns
    # Rows start short and many, then grow at the same tokens per step: (until this step, rows
    # shorter by this factor, batch larger by it). Copying (needles) is learned from the number
    # of examples seen: 8 rows of 256 tokens learned none in 1,300 steps; 32 rows of 64 tokens
    # began to copy digit strings within 300 steps (measured on qwen3-small).
    length_schedule: tuple = ()
    # Long rows mixed among the schedule's: (from this step, every n-th step, rows shorter than
    # `length` by this factor); the first that matches wins. A phase of long rows undid copying
    # (2 rows of 1,024 hold a quarter of the copying examples of 8 rows of 256), so long rows
    # come now and then, to teach the positions past the short rows.
    long_steps: tuple = ()
    # 0: cosine decay from the end of warm-up (kimi-vl was trained so);
    # s > 0: the full rate until the last share s of steps, then cosine (see train._schedule)
    decay_share: float = 0.2
    # (step, rate): a second stage, on the schedule's rows from that step: the rate ramps to
    # `rate` over `warmup` steps and decays by cosine to a tenth at the end (with decay_share 0,
    # the first stage's cosine ends at this step)
    restart: tuple | None = None
    # linear-attention gates: "mlx-lm" (its constructors' A_log / dt_bias) or "reference"
    # (dt log-uniform in [1e-3, 1e-1], A in [1, 16]; see zoo.gates)
    gate_init: str = "mlx-lm"
    tokenizer: str | None = None  # its directory under weights/ (`TOKENIZERS`); None: "tokenizer"

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer or "tokenizer"

    def shape_at(self, step: int) -> tuple[int, int]:
        """(batch, row length) of training step `step`."""
        for start, every, factor in self.long_steps:
            if step >= start and (step - start) % every == 0:
                return self.batch * factor, self.length // factor
        for until, factor in self.length_schedule:
            if step < until:
                return self.batch * factor, self.length // factor
        return self.batch, self.length

    def to_json(self) -> dict:
        data = asdict(self)
        data["mix"] = asdict(self.mix)
        data["length_schedule"] = [list(p) for p in self.length_schedule]
        data["long_steps"] = [list(p) for p in self.long_steps]
        data["restart"] = list(self.restart) if self.restart else None
        return data


def _base(hidden, layers, **extra):
    return dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=3 * hidden,
                rms_norm_eps=1e-6, max_position_embeddings=16384, tie_word_embeddings=True,
                **extra)


# q and k are RMS-normed per head in qwen3 / qwen3_5 attention, so a head's sharpest attention
# grows with sqrt(head_dim): 64 rather than 32 lets a copying head single out one token of 256.
_QWEN35 = dict(model_type="qwen3_5", **_base(128, 4), num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, linear_num_value_heads=4,
               linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
               linear_conv_kernel_dim=4, full_attention_interval=4,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25})

CURRICULA = {c.alias: c for c in [
    # The first model (32 rows of 64 tokens, then 16 x 128, then 8 x 256; 2,500 steps, 37 min on
    # the corpus's first build) recalled 0.94 / 0.48 at 256 / 512. Rows of 512 and 1,024 for its
    # last 500 steps undid copying (0.60 / 0.52 / 0.30 at 256 / 512 / 1,024), and its rows on the
    # recorded corpus with long rows mixed in from step 1,250 began to copy only at step ~2,300
    # (recall 0.46 / 0.32 after 2,500 steps, 43.7 min). So, as kimi-vl, zoo v2's qwen3-small
    # continues the first model with long rows mixed in: 500 steps of rows of 256 with one step
    # in eight of 1,024 and one in four of 512 recalled 0.98 / 0.82 (8.1 min; shipped as
    # weights/seeds/qwen3-small-2, its manifest holding that curriculum), and 500 more from it with
    # every second step of 512 reach the bar.
    Curriculum("qwen3-small", "qwen3", "GQA pair, smaller (KV-Lingo's Qwen3-4B side)", {},
           seed=11, steps=500, batch=2, length=1024, lr=3e-4, warmup=50, decay_share=0.0,
           init_from="seeds/qwen3-small-2", length_schedule=((1 << 30, 4),),
           long_steps=((0, 8, 1), (0, 2, 2))),
    # Like Qwen3-4B -> 8B: wider and deeper, same heads. Hidden 192 x 6 layers (4.0M) left its
    # answer-digit loss near 1.0 nats from step 1,300 to 2,500 and took 72 min; at 160 x 5
    # (2.4M; head_dim 64, GQA 4 / 2) on qwen3-small's first row schedule it learned to copy late
    # (probe recall 0.06 at step 2,200, 0.75 at 2,500) and recalled 0.98 / 0.90 at 256 / 512
    # after 3,200 steps (56.9 min, lr 1e-3 held to step 2,560, on the corpus's first build;
    # shipped as weights/seeds/qwen3-large-1). Zoo v2's continues it on the recorded corpus as
    # qwen3-small's second continuation.
    Curriculum("qwen3-large", "qwen3", "GQA pair, larger (KV-Lingo's Qwen3-8B side)", {},
           seed=12, steps=500, batch=2, length=1024, lr=3e-4, warmup=50, decay_share=0.0,
           init_from="seeds/qwen3-large-1", length_schedule=((1 << 30, 4),),
           long_steps=((0, 8, 1), (0, 2, 2))),
    # Full MLA learns to copy late: the first model (rows of 64, 128, then 256 tokens, cosine
    # rate from step 100; 46 min on the corpus's first build) began at step ~2,200 and recalled
    # 0.98 at 256 but 0.00 at 512. Long rows as a phase undid copying (rows of 512 and 1,024
    # from step 2,600: recall 0.16 / 0.20 / 0.06 at 256 / 512 / 1,024 after 53.5 min), and the
    # first model's schedule on the recorded corpus had only begun to copy by step 3,000 (probe
    # recall 0.12 at 256; 0.12 / 0.12 after 500 more steps with long rows, 50 min). So zoo v2's
    # kimi-vl continues the first model (shipped as weights/seeds/kimi-vl-1) on the recorded
    # corpus: rows of 256 with one step in eight of 1,024 tokens and one in eight of 512.
    Curriculum("kimi-vl", "kimi_vl", "full MLA with RoPE'd rope key (Pair A)", {},
           seed=13, steps=500, batch=2, length=1024, lr=3e-4, warmup=50, decay_share=0.0,
           init_from="seeds/kimi-vl-1", length_schedule=((1 << 30, 4),),
           long_steps=((0, 8, 1), (0, 4, 2))),
    # The reference gates (the first model, trained from mlx-lm's, kept a KDA state that
    # zeroing cost 0.003 nats/token): 30.1 min, recall 1.00 / 0.96 / 0.62 / 0.34 at 1x-8x, and
    # zeroing its states costs 61% of the no-cache KL at 1,024 (recall 0.40 -> 0.00).
    Curriculum("kimi-linear", "kimi_linear", "MLA without RoPE + KDA (Pair A)",
           dict(model_type="kimi_linear", **_base(128, 6), num_attention_heads=4,
                num_key_value_heads=4, head_dim=32, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, mla_use_nope=True, rope_theta=10000.0,
                model_max_length=16384, num_experts=0, moe_intermediate_size=128,
                linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6],
                                    "num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4}),
           seed=14, steps=1200, length_schedule=((540, 4), (900, 2)), gate_init="reference"),
    Curriculum("qwen3.5-a", "qwen3_5", "GQA + Gated DeltaNet hybrid (Pair B, Pair C source)",
           _QWEN35, seed=15, steps=1300, length_schedule=((600, 4), (1000, 2)),
           gate_init="reference"),
    Curriculum("qwen3.5-b", "qwen3_5", "same geometry, next generation: qwen3.5-a trained on (Pair B)",
           {}, seed=16, steps=600, lr=5e-4, warmup=50, init_from="qwen3.5-a",
           mix=Mix(text=0.35, needle=0.3, kv=0.1, dialogue=0.2, copy=0.05, digits=0.05)),
    # the same geometry and schedule as qwen3.5-a, reading the corpus through another tokenizer:
    # the pair that translates across tokenizers
    Curriculum("qwen3.5-xt", "qwen3_5", "GQA + Gated DeltaNet hybrid with its own tokenizer "
           "(the cross-tokenizer pair's target)",
           _QWEN35, seed=18, steps=1300, length_schedule=((600, 4), (1000, 2)),
           gate_init="reference", tokenizer="tokenizer-xt"),
    # Full MLA learns recall late (kimi-vl: after ~2,400 steps); trained from scratch with a
    # sparse phase, 3,200 steps (56 min) reached recall 0.18. So, as DeepSeek-V3.2 was continued
    # from V3.1, dsa continues kimi-vl (same MLA geometry) with an indexer that starts fresh.
    Curriculum("dsa", "deepseek_v32", "MLA + sparse indexer (Pair C target), continued from kimi-vl",
           dict(model_type="deepseek_v32", **_base(128, 4), **_MLA, first_k_dense_replace=4,
                index_head_dim=32, index_n_heads=2, index_topk=64),
           seed=17, steps=800, batch=2, length=1024, lr=5e-4, warmup=50, init_from="kimi-vl",
           dense_warmup=0.25, length_schedule=((1 << 30, 4),),
           long_steps=((0, 8, 1), (0, 4, 2))),
]}


def recorded_curriculum(manifest: dict) -> dict:
    """The curriculum a zoo model's manifest records. Manifests written before the rename keep
    it under "recipe"; the shipped ones are hashed, so they are read as they are."""
    return manifest["curriculum"] if "curriculum" in manifest else manifest["recipe"]
