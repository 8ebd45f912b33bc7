"""Evaluation on held-out prompts (the ``eval:`` section): the evaluator that runs it every
``eval.every`` RL steps on global rank 0 (the source's generation, scored once, the others
waiting on a bounded exchange), its metrics (mean reward, pass@k) and its config rules."""
