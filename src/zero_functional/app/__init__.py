"""The applications on top: the command line, the demo training job, the planner and its
simulation, and the process launcher. They reach the shell only through
:mod:`zero_functional.optimizer` and :mod:`zero_functional.hooks`.
"""
