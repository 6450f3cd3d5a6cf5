"""RL post-training with online draft co-training: GRPO on the policy while the draft learns from the
same rollouts and the policy's detached features (docs/rl.md)."""
