"""Imported last by the tests' forkserver (:data:`tests.helpers.PRELOAD`): ``gc.freeze()`` moves
every object the server has made (torch, the package, what the tests import) into the collector's
permanent generation, as Python's documentation advises before forking.

Each forked rank ends its process group with ``gc.collect()``
(:func:`zero_functional.app.launch.process_group`): a full collection walks every tracked object
and writes to each one's header, so a rank copied the server's whole heap page by page, about
0.25 s of CPU a rank and 0.3-0.6 s of wall time a launch (0.06 s once frozen). What the rank
makes itself is collected as before: a frozen object is never garbage here (the server holds
every one), and an object it refers to still counts as referenced."""

from __future__ import annotations

import gc

gc.freeze()
