"""The sections of the run configuration, one file per group of sections; `unirl.core.run.config`
assembles them into `UnirlConfig`."""
