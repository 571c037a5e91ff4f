"""The engine: part workers, sessions, scheduling and encoding, behind the ports."""
