"""Building blocks shared by the model families: norms, rotary, activations, projections, attention, MoE."""
