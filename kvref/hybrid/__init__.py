"""Hybrid models: attention groups over one page pool (issue 40).

`KVConfig.groups` names each group's layers and attention type
(`kvref.core.groups`); `GroupLayout` maps what an engine names (a label, a
step, a model layer) onto each group's stream, and `KVManager` applies it
at its API, so every mechanism below works per stream as it did.
"""

from kvref.hybrid.layout import GroupLayout

__all__ = ["GroupLayout"]
