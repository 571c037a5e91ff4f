"""Operator commands: verify, lag, Debezium setup, roles and redrive."""
