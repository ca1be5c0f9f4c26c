"""Hybrid recall: the lexical and vector legs fused into typed, calibrated hits."""
