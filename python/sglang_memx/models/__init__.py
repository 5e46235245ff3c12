"""Models: the embedded SmolLM2 and deterministic tiny random models."""
