"""Supervised next-token training: the loop (the runtime it shares with rl/ lives in run/)."""
