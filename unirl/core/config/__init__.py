"""The run's configuration: its frozen attrs sections, their conversion from YAML with the dotted key
in every error, ``--set`` overrides, the cross-section rules, and the values the RL step derives
from it (loss and advantage settings, the head path, routing replay, the model's shape)."""
