"""KV messenger: moves KV pages from prefill ranks to decode ranks (layout spec, shard plan, transports)."""
