"""The shipped zoo models and translators (data only; see README.md)."""
