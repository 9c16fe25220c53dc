"""Training: the train state and step, the optimizer, the loop, metrics and the token data."""
