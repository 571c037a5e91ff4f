"""The core: the domain model, the ports, settings and the rules every other part uses."""
