"""Pinned third-party artifacts: Maven jars checksum-verified into the user's cache.

A neutral package: both the local dev stack (:mod:`relay.localstack`: Kafka's broker,
Debezium Server) and the shipped Spark jobs (:mod:`spark_jobs`: Spark's Kafka connector)
fetch their jars through :mod:`relay.artifacts.maven`, so a Spark job does not depend on
the dev stack. Every Maven lock file lives here, beside the fetcher that reads it, so
``python -m relay.artifacts.maven lock|fetch NAME`` works for each of them. This package
imports nothing from the relay but its error root.
"""
