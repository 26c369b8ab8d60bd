"""Prompt chunk hashing and the approximate chunk -> endpoint index.

Pure Python on purpose (no grpc, Kubernetes or asyncio imports): the offline simulator uses
these classes unchanged.
"""
