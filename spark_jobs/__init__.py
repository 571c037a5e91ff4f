"""Spark Structured Streaming jobs consuming the relay's topics (see issue: Spark consumers)."""
