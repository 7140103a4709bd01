"""GRPO post-training: sampler, rewards, advantages, the policy update and the run around them."""
