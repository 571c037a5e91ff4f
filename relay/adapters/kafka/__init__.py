"""The Kafka adapter: producers, readers, topics and broker watching."""
