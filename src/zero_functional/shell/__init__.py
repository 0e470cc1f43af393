"""The shell: the stateful parts that the facade (:mod:`zero_functional.optimizer`) and the
hooks (:mod:`zero_functional.hooks`) compose; no module here names the facade."""
