"""The schema registry adapter: compatibility checks and the Confluent wire format."""
