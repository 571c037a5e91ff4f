"""The Postgres adapter: connections, SQL, the store and migrations."""
