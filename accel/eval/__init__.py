"""Evaluation: perplexity over non-overlapping windows of real text, paired statistics between arms."""
