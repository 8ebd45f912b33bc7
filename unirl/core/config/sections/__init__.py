"""The sections of the run configuration, one file per group of sections; `unirl.core.config.run_config`
assembles them into `UnirlConfig`."""
