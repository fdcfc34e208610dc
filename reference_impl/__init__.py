"""The reference implementation: expert layout, MoE layer, ExpertLayout and its checkpoint path."""
