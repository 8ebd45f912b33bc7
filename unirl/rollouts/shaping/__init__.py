"""What a generating source does to a rollout's data before it is trained on (DAPO's data side):
dynamic sampling (groups with equal rewards dropped, more prompts drawn), the soft overlong
penalty, and the settings value both are built into, with what `unirl check` says of them."""
