"""`parallm bench`, `parallm demo`, the peers it runs against and test fixtures: tooling,
never imported by the runtime package ``parallm_engine``."""
