"""Parity between torchtrain (the trainer) and jaxref (the oracle)."""
