"""The stateful shell's parts: the local shard, parameter and gradient sync, overlap mode's
state, the steppers, AMP verdicts, agreement and Join.

:mod:`zero_functional.optimizer` and :mod:`zero_functional.hooks` compose them; nothing outside
the shell, those two and the checkpoint code imports them (``.ci/rules.py`` checks ``app/``).
"""
