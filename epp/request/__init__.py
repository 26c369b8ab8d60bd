"""Parsing OpenAI-style request bodies into one ``InferenceRequest`` value."""
