"""Training drafters from the target's own outputs and features."""
