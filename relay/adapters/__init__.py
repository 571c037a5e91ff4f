"""The adapters: Postgres, Kafka and the schema registry."""
