"""The suite's environment, set before any test starts a store or a rank.

torch's TCP store looks up the name of every connection's peer address (for its log
lines). On a machine whose resolver drops some reverse look-ups (this project's CI
machines drop one in 25), each dropped one holds a new store connection, or a server
accepting one, for glibc's default 5 s; rank processes inherit the setting below, which
caps that at 1 s. pdist itself opens no connection after a failure (a survivor uses the
one its block opened), so this changes how long the suite takes, not what it asserts.
"""

from __future__ import annotations

import os

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")
