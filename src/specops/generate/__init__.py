"""The generate phase: prompts -> target responses, journaled exactly once per sample id."""
