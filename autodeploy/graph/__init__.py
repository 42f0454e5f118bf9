"""FX graph utilities: cleanup, fake-tensor metadata, the pattern matcher and rewrite rules."""
