"""The running aggregator: the MQTT loop, the job runners, ingest, recovery and operator actions."""
