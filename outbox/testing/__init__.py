"""Sinks for fault injection and benchmarks: used beside the real sinks, never instead."""
