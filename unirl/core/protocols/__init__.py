"""The seams plug-ins fill: what a backend plug-in and a rollout-source plug-in declare (name,
own config section, rules, constructor, capabilities) and the typed view of the config their
rules read. The backend interface itself is `unirl.core.backend`."""
