"""Settings: one schema, one resolver, one tuned format."""
