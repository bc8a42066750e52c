"""The two kinds of decoder layer, spelled as Qwen3.5's config.json spells them in
`layer_types`. A module of their own, so that the FLOP counts and the model args both read them
without importing each other."""

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
