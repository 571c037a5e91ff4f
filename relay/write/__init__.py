"""The write API: appending events to the outbox."""
